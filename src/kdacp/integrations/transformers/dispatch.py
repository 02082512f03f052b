"""``kdacp.parallelize`` and ``kdacp.integrations.transformers.torch_fallbacks`` over every supported transformers model,
dispatched on ``model.config.model_type``."""
from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ...cp.context import ContextParallel
from ...layers.delta_rule import DeltaRuleLayer
from . import kimi_linear, qwen3_next
from .loading import say_kernel_fallbacks_once

# config.model_type -> the model's name in messages
SUPPORTED_MODELS = {"kimi_linear": "KimiLinearForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
_ADAPTERS = {"kimi_linear": kimi_linear, "qwen3_next": qwen3_next}


def parallelize(model: nn.Module, cp, *, layout=None, loss_group=None) -> nn.Module:
    """Apply context parallelism to a model in place, from outside its code: transformers'
    ``KimiLinearForCausalLM`` (:func:`kdacp.integrations.transformers.kimi_linear.parallelize`) or ``Qwen3NextForCausalLM``
    (:func:`kdacp.integrations.transformers.qwen3_next.parallelize`), or their base models; or any other module built of kdacp's
    own layers (:class:`kdacp.KimiDeltaAttention`, :class:`kdacp.GatedDeltaNet`), whose ``cp`` it sets (None
    turns context parallelism off there; the caller shards the tokens). The model's own parameters are
    used in place (``model.state_dict()`` unchanged). Call it on every rank, before FSDP2's ``fully_shard``,
    DDP or activation checkpointing; feed each rank ``kdacp.shard_batch(...).model_kwargs()``.

    Args:
        model: the model.
        cp: a :class:`kdacp.ContextParallel`, or a ``DeviceMesh`` (:meth:`ContextParallel.from_mesh`:
            1-D: ``state`` mode; 2-D ``(state, ulysses)``: ``hybrid``).
        layout: the token layout every batch is sharded by (``"contiguous"``, ``"zigzag"``,
            ``"document_zigzag"``, ``"balanced_documents"`` or a :class:`~kdacp.cp.layout.TokenLayout`;
            all but contiguous balance the softmax attention's causal work): with a mesh, the context's layout;
            with a ``ContextParallel``, it must be that context's (default: the context's, or contiguous for a
            mesh). Shard each batch with ``kdacp.shard_batch(..., layout=)`` of the same layout; the model refuses
            one of another.
        loss_group: the ranks of the model's ``.loss`` (the loss-scaling contract of
            :mod:`kdacp.cp.sharding`): a process group or 1-D mesh, the flattened dp x cp mesh under
            FSDP2/DDP; default: the context-parallel group.

    Returns:
        ``model``.

    Raises:
        ValueError: a model of another type (``config.model_type``) with none of kdacp's layers, a ``layout``
            other than ``cp``'s, or what the model's adapter refuses.
        ImportError: transformers missing or without the model (the ``models`` extra).
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    own_layers = [m for m in model.modules() if isinstance(m, DeltaRuleLayer)]
    if model_type not in SUPPORTED_MODELS and own_layers:
        if isinstance(cp, DeviceMesh):
            cp = ContextParallel.from_mesh(cp, layout="contiguous" if layout is None else layout)
        for layer in own_layers:
            layer.cp = cp
        return model
    if model_type not in SUPPORTED_MODELS:
        names = ", ".join(SUPPORTED_MODELS.values())
        raise ValueError(f"kdacp.parallelize supports transformers' {names} (and their base models); got "
                         f"{type(model).__name__} with config.model_type={model_type!r}")
    say_kernel_fallbacks_once()  # for a model built without kdacp's loaders
    if isinstance(cp, DeviceMesh):
        cp = ContextParallel.from_mesh(cp, layout="contiguous" if layout is None else layout)
    elif layout is not None and isinstance(cp, ContextParallel) and cp.layout != layout:
        raise ValueError(f"layout={layout!r} differs from the context's own layout {cp.layout!r}: give it to "
                         "ContextParallel(..., layout=) or pass a DeviceMesh")
    return _ADAPTERS[model_type].parallelize(model, cp, loss_group)


@contextlib.contextmanager
def torch_fallbacks():
    """Inside the block, transformers' unmodified supported models (Kimi Linear, Qwen3-Next) run their own
    PyTorch code instead of the kernel packages transformers bound at import (FLA's Triton kernels, which fail
    on tensors without a GPU); restored on exit. That code ignores packed-sequence boundaries."""
    with contextlib.ExitStack() as stack:
        for adapter in _ADAPTERS.values():
            stack.enter_context(adapter.torch_fallbacks())
        yield
