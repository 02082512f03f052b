"""The hooks a gated delta-rule token mixer calls on its context-parallel mode, declared once.

:func:`kdacp.layers.delta_rule.mix_tokens` runs the same code on one device and under context parallelism;
what differs is behind these hooks, called in this order: :meth:`CPHooks.to_heads`, :meth:`CPHooks.head_slice`,
:meth:`CPHooks.context` (whose :meth:`~kdacp.cp.CPContext.short_convolution` and
:meth:`~kdacp.cp.CPContext.recurrence` run the mixer's exchanges), :meth:`CPHooks.to_sequence` (and
:meth:`CPHooks.validate_heads` when a layer is given the mode). Implementations:
:data:`~kdacp.cp.context.SINGLE_DEVICE`, :class:`~kdacp.cp.ContextParallel` and the prefill's
:class:`kdacp.integrations.transformers.prefill.LayerPrefill`; each subclasses :class:`CPHooks` and defines every hook.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .batch_context import CPContext

__all__ = ["CPHooks"]


class CPHooks(Protocol):
    """How a token mixer runs: on one device, or over ranks (see the module).

    Attributes:
        backend: the recurrence's backend (``"auto"``, ``"torch"``, ``"fla"``), or None for the layer's own.
        split: the recurrence's split inside the device (``"auto"`` or an int, as :func:`kdacp.chunk_kda`'s
            ``split``), or None for the layer's own.
    """

    backend: str | None
    split: str | int | None

    def validate_heads(self, num_heads: int, num_v_heads: int) -> None:
        """Raise ``ValueError`` unless the head counts suit this mode (a layer calls it when given the mode)."""
        ...

    def to_heads(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's tokens ``[B, T, C_i]`` -> what its recurrence runs on (the same, or head shards of the
        whole sequence ``[B, U*T, C_i/U]``)."""
        ...

    def head_slice(self, num_heads: int) -> slice:
        """This rank's share of ``num_heads`` heads after :meth:`to_heads`."""
        ...

    def context(self, B: int, T: int, cu_seqlens: torch.Tensor | None, device=None) -> CPContext:
        """The batch's :class:`~kdacp.cp.CPContext` (the mixer runs its ``short_convolution`` and
        ``recurrence``), ``B`` rows of ``T`` tokens after :meth:`to_heads` or the packed row of global
        ``cu_seqlens``."""
        ...

    def to_sequence(self, o: torch.Tensor, final_state: torch.Tensor | None):
        """The inverse of :meth:`to_heads` on the output, and the final state ``[N, HV, K, V]`` whole on every
        rank; returns ``(o, final_state)``."""
        ...

