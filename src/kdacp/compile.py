"""``torch.compile`` of code that calls kdacp's context-parallel regions: a region runs as one opaque custom op.

What ``torch.compile`` cannot trace in a context-parallel token mixer is the part that reads the batch's document
boundaries on the host (plans, routes, local boundaries; :mod:`kdacp.cp`) and exchanges states between
ranks. Traced, those host values would become constants of the graph (a new graph for every batch), and the
exchanges would break it. :func:`run_opaque` hands such a part to the graph as one call of the custom op
``kdacp::opaque_region``: the graph holds the region's tensors (the boundaries among them, as a tensor, never their
values) and the region's static settings, baked once as the id of its :class:`OpaqueRegion`; the region runs in
eager PyTorch inside the op, whatever the backend (``aot_eager``, ``inductor``), so a new batch replays the same
graph. A region given an integer tensor (the boundaries) is the op ``kdacp::opaque_region_reading_values`` instead,
tagged ``torch.Tag.cudagraph_unsafe``: Inductor's CUDA graphs (``mode="reduce-overhead"``) leave it out, since a
replay would launch the work of the batch recorded, not the one given.

Autograd: the op's backward (``kdacp::opaque_region_backward``) runs the region again, this time with autograd,
and differentiates it (as activation checkpointing does): nothing is kept between the two ops but their inputs,
so a region in flight twice, or re-run by checkpointing, needs no bookkeeping. The cost is one more forward of the
region per backward (its exchanges included, on every rank alike).

Outside ``torch.compile`` :func:`run_opaque` calls the region directly (its own autograd, nothing re-run).

Use: ``torch.compile(kdacp.parallelize(model, cp), fullgraph=True)`` traces a Hugging Face model's whole forward,
its loss included, in one graph (:func:`kdacp.layers.delta_rule.mix_tokens` runs its convolutions and recurrence
as one region, the softmax attention of :mod:`kdacp.integrations.transformers.attention` its exchanges and inner attention as
another: both look the batch's one context up and read it on the host). A batch with other boundaries replays the
graph; the number of documents is a shape (``cu_seqlens [N+1]``): mark it dynamic,
``torch._dynamo.mark_dynamic(batch.cu_seqlens, 0)``, or the first batch with another count compiles once more
(after which torch treats that size as dynamic).
"""
from __future__ import annotations

import contextlib
import types
import weakref
from typing import Protocol

import torch
from torch._C import DispatchKey

__all__ = ["OpaqueRegion", "hold_for_regions", "region_count", "run_opaque"]


class OpaqueRegion(Protocol):
    """A part of a computation that runs outside the graph. Built from static settings only (hashable: the
    same settings give an equal region, which the graph names by one id); called on tensors."""

    def __call__(self, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The region in eager PyTorch, differentiable: a fixed number of new tensors (none aliasing an
        input), that number set by the settings."""

    def fake(self, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Contiguous tensors of the shapes, dtypes and devices :meth:`__call__` returns for ``inputs`` (which may
        be fake tensors: read their shapes only). The op returns the region's outputs contiguous: a compiled graph
        takes their strides from here."""


_REGIONS: list[OpaqueRegion] = []  # the region of each id: made once per distinct settings, for the process
_IDS: dict[OpaqueRegion, int] = {}


def region_count() -> int:
    """How many distinct regions the process has given an id (each is kept for the process's lifetime,
    with what its settings hold: one per mixer kind and context and one per attention module, not per batch)."""
    return len(_REGIONS)


# The objects among regions' settings, by id(): compiled code names such an object by its id (torch 2.11's dynamo
# hands a constant function no object; 2.13's does) and the region is built from the object found here.
_HELD: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_HELD_MARK = "kdacp held object"  # (mark, id) stands for a held object in a region's settings
# settings that compiled code passes as they are (tuples of them too)
_PLAIN = (type(None), bool, int, float, str, type, types.FunctionType, torch.dtype)


def hold_for_regions(obj) -> None:
    """Let ``obj`` (weakly referable) be among the settings of a region that runs under ``torch.compile``: call
    once where ``obj`` is made (kdacp's context-parallel hooks and attention settings do). It is held weakly,
    for as long as it lives elsewhere."""
    _HELD[id(obj)] = obj


def _setting_key(setting):
    """``setting`` as compiled code passes it to :func:`_region_id`: plain values as they are, a held object as
    ``(mark, id)``."""
    if isinstance(setting, tuple):
        return tuple(_setting_key(s) for s in setting)
    if isinstance(setting, _PLAIN):
        return setting
    return (_HELD_MARK, id(setting))


def _setting(key):
    """The setting of :func:`_setting_key`'s ``key``."""
    if isinstance(key, tuple) and len(key) == 2 and key[0] == _HELD_MARK:
        obj = _HELD.get(key[1])
        if obj is None:
            raise RuntimeError("a region's setting under torch.compile is an object that kdacp.compile."
                               "hold_for_regions was not given where it was made")
        return obj
    return tuple(_setting(k) for k in key) if isinstance(key, tuple) else key


@torch.compiler.assume_constant_result
def _region_id(kind: type, *keys) -> int:
    """The id of ``kind(*settings)`` (``keys``: the settings as :func:`_setting_key` gives them), given on its
    first request. A constant for ``torch.compile``: the graph holds the number, not the lookup."""
    region = kind(*(_setting(k) for k in keys))
    if region not in _IDS:
        _IDS[region] = len(_REGIONS)
        _REGIONS.append(region)
    return _IDS[region]


def run_opaque(kind: type, settings: tuple, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``kind(*settings)(*inputs)``: directly in eager mode; under ``torch.compile``, as one call of the
    opaque custom op (see the module docstring).

    Args:
        kind: an :class:`OpaqueRegion` class; ``settings``: its constructor's arguments (hashable: plain values,
            tuples of them, and objects compared by identity, which under ``torch.compile`` must have been given
            to :func:`hold_for_regions`).
        inputs: the region's tensors (or None); gradients flow to those that require them.

    Returns:
        The region's output tensors.
    """
    if not torch.compiler.is_compiling():
        return kind(*settings)(*inputs)
    # The op takes no None in its list (a None there hides every input's requires_grad from autograd).
    present = [x is not None for x in inputs]
    tensors = [x for x in inputs if x is not None]
    reads_values = any(not (x.dtype.is_floating_point or x.dtype.is_complex) for x in tensors)
    return tuple(_REGION_OPS[reads_values](_region_id(kind, *_setting_key(settings)), tensors, present))


def _with_nones(tensors, present) -> list:
    """The region's inputs: ``tensors`` with a None where ``present`` says."""
    it = iter(tensors)
    return [next(it) if p else None for p in present]


def _own(outputs, inputs) -> list[torch.Tensor]:
    """``outputs`` as a custom op may return them: contiguous (the strides its fake implementation gives), and
    a copy of any that shares memory with an input."""
    taken = {x.untyped_storage().data_ptr() for x in inputs if x is not None}
    return [y.clone(memory_format=torch.contiguous_format) if y.untyped_storage().data_ptr() in taken
            else y.contiguous() for y in outputs]


@contextlib.contextmanager
def _autograd_inside_op():
    """Autograd recording inside a custom op's implementation, which the dispatcher runs with the autograd
    keys excluded (and hence records nothing, even under ``enable_grad``)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradFunctionality, DispatchKey.ADInplaceOrView):
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


def _define_region_ops(name: str, tags: tuple):
    """Register the custom op ``kdacp::<name>`` (a region's outputs) and ``kdacp::<name>_backward`` (its
    gradients), both with ``tags``, and the first's fake implementation and autograd; return the first."""

    @torch.library.custom_op(f"kdacp::{name}", mutates_args=(), tags=tags)
    def region_op(region: int, inputs: list[torch.Tensor], present: list[bool]) -> list[torch.Tensor]:
        """The region's outputs on its ``inputs`` (the non-None ones; ``present``: where they go among its
        arguments)."""
        with torch.no_grad():  # the backward op re-runs the region with autograd: nothing to record here
            return _own(_REGIONS[region](*_with_nones(inputs, present)), inputs)

    @region_op.register_fake
    def _(region, inputs, present):
        return list(_REGIONS[region].fake(*_with_nones(inputs, present)))

    @torch.library.custom_op(f"kdacp::{name}_backward", mutates_args=(), tags=tags)
    def backward_op(region: int, inputs: list[torch.Tensor], present: list[bool], differentiable: list[bool],
                    grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """The gradients of the ``differentiable`` inputs, in order (contiguous), for the outputs' gradients
        ``grads``."""
        with _autograd_inside_op():
            leaves = [x.detach().requires_grad_() if d else x for x, d in zip(inputs, differentiable)]
            outputs = _REGIONS[region](*_with_nones(leaves, present))
            pairs = [(y, g) for y, g in zip(outputs, grads) if g is not None and y.requires_grad]
            wrt = [x for x, d in zip(leaves, differentiable) if d]
            found = torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
                if pairs else [None] * len(wrt)
        return [x.new_zeros(x.shape) if g is None else g.contiguous() for x, g in zip(wrt, found)]

    @backward_op.register_fake
    def _(region, inputs, present, differentiable, grads):
        return [x.new_empty(x.shape) for x, d in zip(inputs, differentiable) if d]

    def setup_context(ctx, inputs, output):
        ctx.region, tensors, ctx.present = inputs
        ctx.save_for_backward(*tensors)

    def backward(ctx, grads):
        # which inputs need a gradient, as autograd saw them when the op ran (dynamo's own view of
        # ``requires_grad`` misses a tensor that an in-place copy made differentiable)
        differentiable = list(ctx.needs_input_grad[1])
        found = iter(getattr(torch.ops.kdacp, f"{name}_backward")(ctx.region, list(ctx.saved_tensors), ctx.present,
                                                                  differentiable, list(grads)))
        return None, [next(found) if d else None for d in differentiable], None

    region_op.register_autograd(backward, setup_context=setup_context)
    return getattr(torch.ops.kdacp, name)


# A region given an integer tensor reads its values on the host (a batch's document boundaries) and launches
# accordingly. Replayed from a CUDA graph (``torch.compile(mode="reduce-overhead")``) it would run with the
# boundaries of the batch it was recorded on, whatever the batch: its ops carry ``torch.Tag.cudagraph_unsafe``,
# which Inductor runs outside its CUDA graphs (in a partition of their own, or the graph not captured).
_CUDAGRAPH_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
_REGION_OPS = {False: _define_region_ops("opaque_region", ()),
               True: _define_region_ops("opaque_region_reading_values", _CUDAGRAPH_UNSAFE)}
