"""The stage interface every local (one-rank) KDA backend implements.

The stages are split where context parallelism has to wait: everything that does not depend on a
sequence's incoming state (gates, intra-chunk WY work, state summaries, the state-gradient summary)
is separate from the state pass and output (forward) and from the gradient pass (backward), so the
distributed op can start it before the exchange completes.

All tensors are one packed row: ``q, k [1, T, H, K]``, ``v [1, T, HV, V]``, ``g [1, T, HV, K]``
(``[1, T, HV]`` for a scalar gate, :attr:`KDAOptions.gate`), ``beta [1, T, HV]``; a :class:`Span` picks
whole segments ``[start, end)`` of it. States and summaries are float32 (float64 for float64 inputs):
``[n, HV, K, V]`` with ``n`` the span's segments.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from ..host_copies import host_tensor


@dataclass(frozen=True)
class KDAOptions:
    """Per-call settings shared by all stages (FLA's argument names, and ``summary_precision``: the
    summary kernels' precision policy, a :class:`kdacp.kernels.SummaryPrecision` name or ``None`` for the
    default of the inputs' dtype; read by the ``fla`` backends only), and ``gate``: the gate's kind, of
    :data:`GATE_KINDS`: ``"channel"`` (KDA: one decay per value head, channel and token, ``g [1, T, HV, K]``,
    ``dt_bias [HV*K]``) or ``"scalar"`` (GDN: one per value head and token, ``g [1, T, HV]``, ``dt_bias [HV]``).
    A backend runs the kind its options name; one whose kernels take only the per-channel gate runs a scalar
    one through :class:`kdacp.backends.gate.BroadcastGate`."""

    scale: float
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    lower_bound: float | None = None
    safe_gate: bool = False
    chunk_size: int = 64
    summary_precision: str | None = None
    gate: str = "channel"

    def __post_init__(self):
        if self.gate not in GATE_KINDS:
            raise ValueError(f"gate must be one of {GATE_KINDS}, got {self.gate!r}")


# The kinds of gate (:attr:`KDAOptions.gate`): per channel (KDA) or one scalar per value head (GDN).
GATE_KINDS = ("channel", "scalar")


@dataclass
class KDAInputs:
    """The raw inputs of one packed row (``A_log [HV]`` and ``dt_bias`` only with the gate in kernel); ``g`` and
    ``dt_bias`` of the call's gate kind (:attr:`KDAOptions.gate`): ``[1, T, HV, K]`` and ``[HV*K]`` per
    channel, ``[1, T, HV]`` and ``[HV]`` scalar."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class Span:
    """Local tokens ``[start, end)`` made of whole segments; ``cu_seqlens`` relative to ``start``."""

    start: int
    end: int
    cu_seqlens: tuple[int, ...]

    @property
    def num_segments(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def empty(self) -> bool:
        return self.end <= self.start

    def prefix(self, segments: int) -> "Span":
        """The span of this span's first ``segments`` segments."""
        return self.segments(0, segments)

    def segments(self, first: int, last: int) -> "Span":
        """The span of this span's segments ``first`` to ``last - 1``."""
        cu = self.cu_seqlens[first:last + 1]
        return Span(self.start + cu[0], self.start + cu[-1], tuple(c - cu[0] for c in cu))

    def cut(self, starts: tuple[int, ...]) -> "Span":
        """This span with its segments cut into pieces beginning at ``starts`` (token offsets from its
        first token, increasing, holding every segment's own first token)."""
        length = self.end - self.start
        if list(starts) != sorted(set(starts)) or not set(self.cu_seqlens[:-1]) <= set(starts) \
                or starts[-1] >= length:
            raise ValueError(f"cannot cut a span of {length} tokens with segments at {self.cu_seqlens} at {starts}: "
                             f"expected increasing offsets below {length} that include every segment's start")
        return Span(self.start, self.end, (*starts, length))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The span's tokens of a token-first ``x [1, T, ...]``: ``x`` itself when the span covers it
        (no view made: a view costs host time on every stage call), else ``x[:, start:end]``."""
        return x if self.start == 0 and self.end == x.shape[1] else x[:, self.start:self.end]

    def cu_seqlens_host(self) -> torch.Tensor | None:
        """``[n+1]`` int64 on the CPU, or ``None`` for a single segment (the faster unpacked path); for
        launchers that read the boundaries on the host (no device sync). Shared between calls
        (:func:`~kdacp.host_copies.host_tensor`): read, never modify."""
        return None if self.num_segments == 1 else host_tensor(self.cu_seqlens)


@dataclass
class LocalStates:
    """A span's state pass: ``final_state [n, HV, K, V]`` (or ``None``); ``h`` (the state before
    each chunk) and ``v_new [1, T_span, HV, V]`` where the backend exposes them (else ``None``),
    which backward may reuse instead of recomputing."""

    final_state: torch.Tensor | None
    h: torch.Tensor | None = None
    v_new: torch.Tensor | None = None


@dataclass(frozen=True)
class BackwardStates:
    """A span's gradient state pass, as ``backward_states`` returns it and ``backward_inputs`` takes it:
    the ``span`` and ``dinitial_state [n, HV, K, V]``, the gradient of its segments' initial states.
    Each backend subclasses it with what its ``backward_inputs`` reads, so that stage cannot run
    before the state pass."""

    span: Span
    dinitial_state: torch.Tensor


@dataclass
class LocalGrads:
    """Gradients of one span: token-wise ``[1, T_span, ...]`` like the inputs, ``dA_log [HV]`` and
    ``ddt_bias`` (``dt_bias``'s shape) summed over the span (or ``None``)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dA_log: torch.Tensor | None
    ddt_bias: torch.Tensor | None


class LocalBackend(Protocol):
    """One rank's chunked KDA, in stages, for one call's :class:`KDAOptions`.

    Forward: ``prepare`` (state-independent work on all local tokens) -> per span ``state_summary``
    and/or ``state_pass`` -> ``output``. ``to_saved`` keeps what backward needs (a dataclass whose
    fields are tensors or ``None``, stored with ``save_for_backward``).
    Backward per span: ``backward_local`` (everything that needs no final-state gradient) ->
    ``state_gradient_summary`` and/or ``backward_states`` (the gradient state pass) ->
    ``backward_inputs``. Each stage's result is a value the next one takes; no stage changes
    another's result, so a stage can only run once what it needs exists.
    """

    name: str
    options: KDAOptions
    # Whether a through rank runs its state pass over its summary's pieces at once, each from the state
    # entering it (``state_summary(parts=True)``), rather than along its whole segment: only where the
    # backend's state kernel is faster so (measured on one H200 at 16K tokens, 32 heads of 128: FLA's GDN
    # state kernel 0.311 -> 0.206 ms in two pieces; FLA's KDA kernel 0.421 -> 0.422 ms; benchmarks/RESULTS.md).
    parallel_pieces: bool
    # Whether ``state_summary`` can return the summaries of pieces (``parts``), which the split inside one
    # device (:mod:`kdacp.cp.split`) needs.
    summary_pieces: bool

    def prepare(self, inputs: KDAInputs, span: Span): ...

    def state_summary(self, chunks, span: Span, with_transition: bool, parts: bool = False,
                      chunks_per_piece: int | None = None):
        """``AffineMap(offset=S_ext [n, HV, K, V], transition=M [n, HV, K, K] or None)``. ``parts`` (with
        the transition): :class:`~kdacp.affine.SummaryParts`, the summaries and those of consecutive
        pieces of each segment, so that the state pass can run over all pieces at once
        (``span.cut(parts.starts)``) from :func:`~kdacp.affine.entry_states`; ``chunks_per_piece``: each
        segment cut every that many chunks from its first token (``None``: the backend's choice)."""

    def state_pass(self, chunks, span: Span, initial_state: torch.Tensor, output_final_state: bool) -> LocalStates:
        """The states of ``span`` from ``initial_state [n, HV, K, V]``."""

    def output(self, chunks, span: Span, initial_state: torch.Tensor, states: LocalStates) -> torch.Tensor:
        """``o [1, T_span, HV, V]`` in v's dtype."""

    def to_saved(self, chunks): ...

    def backward_local(self, saved, span: Span, do: torch.Tensor, initial_state: torch.Tensor,
                       states: LocalStates | None = None):
        """Backward work of ``span`` that needs no final-state gradient; ``states`` from the
        forward state pass of exactly this span, if kept."""

    def state_gradient_summary(self, local, segments: tuple[int, int] | None = None) -> torch.Tensor:
        """``G [n, HV, K, V]``: the gradient reaching each segment's initial state when its final
        state's gradient is zero; ``segments = (first, last)``: of those segments of ``local``'s span only
        (``n = last - first``), else of all."""

    def backward_states(self, local, dht: torch.Tensor | None, segments: int | None = None) -> BackwardStates:
        """The gradient state pass of ``local`` (from :meth:`backward_local`) given the final-state
        gradient ``dht [n, HV, K, V]`` (or ``None``: zero); its ``dinitial_state [n, HV, K, V]``
        is the initial-state gradient. ``segments``: the pass over only the first ``segments`` of
        ``local``'s segments (``n = segments``; the result is of that prefix of the span)."""

    def backward_inputs(self, states: BackwardStates) -> LocalGrads:
        """The input gradients of ``states.span``, from :meth:`backward_states`'s result."""


TMA_ALIGNMENT = 128  # bytes: kernels that load through the TMA (attention-gym's, FlashQLA's) need it


def tma_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a cut of a token-first tensor), copied where its first element is not :data:`TMA_ALIGNMENT`-aligned:
    only narrow per-token tensors (``beta``, a scalar gate ``[1, T, HV]``) cut at a token that is not a multiple of
    the chunk can be."""
    return t if t.storage_offset() * t.element_size() % TMA_ALIGNMENT == 0 else t.clone()


def tensor_fields(obj) -> list:
    """The field values of a dataclass of tensors, in order (for ``save_for_backward``)."""
    return [getattr(obj, f.name) for f in fields(obj)]
