"""A scalar gate on a backend whose kernels take only the per-channel one: the one place GDN's gate is
broadcast over ``K``.

GDN's gate is one decay per value head and token (``g [1, T, HV]``, ``dt_bias [HV]``;
:attr:`~kdacp.backends.base.KDAOptions.gate` ``"scalar"``). Backends with kernels of their own for it
(FLA's GDN kernels, attention-gym's GDN core) run it as it is; a per-channel backend (the ``torch``
backend's KDA reference, FLA's KDA kernels where FLA refuses its GDN backward, any registered backend
whose spec does not run the scalar gate) runs it wrapped in :class:`BroadcastGate` (:func:`build_for_gate`),
which hands the inner backend the broadcast ``g [1, T, HV, K]`` (a view) and ``dt_bias [HV*K]`` and sums
their gradients back over ``K``.
"""
from __future__ import annotations

from dataclasses import replace

from .base import KDAInputs, KDAOptions, LocalBackend, LocalGrads, Span
from ..reference.gdn import scalar_gate_as_kda


class BroadcastGate:
    """``inner`` (built with the per-channel gate) run on a scalar gate: the stages are ``inner``'s, but
    :meth:`prepare` broadcasts the gate and :meth:`backward_inputs` returns the scalar gate's gradients
    (``dg [1, T, HV]``, ``ddt_bias [HV]``), summed over ``K`` in the inputs' dtypes, as autograd sums a
    broadcast's gradient."""

    def __init__(self, inner: LocalBackend):
        if inner.options.gate != "channel":
            raise ValueError(f"BroadcastGate wraps a backend of the per-channel gate, got gate={inner.options.gate!r}")
        self.inner = inner
        self.options = replace(inner.options, gate="scalar")
        self._dtypes = None  # (K, g's dtype, dt_bias's dtype), from prepare

    def __getattr__(self, name):  # its name, settings and the stages that see no gate input or gradient: inner's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def prepare(self, inputs: KDAInputs, span: Span):
        K = inputs.q.shape[-1]
        g, dt_bias = scalar_gate_as_kda(inputs.g, K, inputs.dt_bias)
        self._dtypes = (K, inputs.g.dtype, None if inputs.dt_bias is None else inputs.dt_bias.dtype)
        return self.inner.prepare(replace(inputs, g=g, dt_bias=dt_bias), span)

    def backward_inputs(self, states) -> LocalGrads:
        grads = self.inner.backward_inputs(states)
        K, g_dtype, dt_dtype = self._dtypes
        dg = grads.dg.to(g_dtype).sum(-1)
        ddt_bias = None if grads.ddt_bias is None or dt_dtype is None else \
            grads.ddt_bias.to(dt_dtype).reshape(-1, K).sum(-1)
        return replace(grads, dg=dg, ddt_bias=ddt_bias)


def build_for_gate(spec, options: KDAOptions, training: bool) -> LocalBackend:
    """The backend of ``spec`` (a :class:`~kdacp.backends.registry.BackendSpec`) for one call's ``options``,
    dispatched on the gate's kind: per channel, ``spec.build(options, False)``; scalar, on the spec's kernels
    of the scalar gate where it runs them (:attr:`~kdacp.backends.registry.BackendSpec.runs_scalar_gate`),
    ``spec.build(options, True)``, else on its per-channel kernels, built for the per-channel gate and wrapped
    in :class:`BroadcastGate`."""
    if options.gate == "channel":
        return spec.build(options, False)
    if spec.runs_scalar_gate(training):
        return spec.build(options, True)
    return BroadcastGate(spec.build(replace(options, gate="channel"), False))
