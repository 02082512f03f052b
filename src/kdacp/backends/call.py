"""One call's preparation, shared by the single-device op (``kdacp.chunk_kda``) and the
context-parallel one (``kdacp.chunk_kda``), and by GDN's (``kdacp.chunk_gated_delta_rule``, with the scalar
gate): the backend chosen once (:func:`choose_call_backend`), options (the gate's kind among them), the
backend instance, the inputs packed into one row, and the casting of the gradients back to the inputs'
dtypes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import KDAInputs, KDAOptions, LocalBackend, LocalGrads
from .gate import build_for_gate
from .registry import BACKEND_SPECS, BackendSpec, CallFacts, choose_backend


@dataclass(frozen=True)
class PreparedCall:
    """``backend`` (holding the call's :class:`KDAOptions`, the gate's kind among them), ``inputs``: q, k, v,
    g, beta packed into one row ``[1, B*T, ...]`` (views) with ``A_log``/``dt_bias`` only with the gate in
    kernel, and the ``B, T, HV, V`` the output is shaped back with."""

    backend: LocalBackend
    inputs: KDAInputs
    B: int
    T: int
    HV: int
    V: int

    def unpack(self, o: torch.Tensor) -> torch.Tensor:
        """``o [1, B*T, HV, V]`` -> ``[B, T, HV, V]`` (``o`` itself when ``B == 1``)."""
        return o if self.B == 1 else o.view(self.B, self.T, self.HV, self.V)


def prepare_call(backend_name: str, q, k, v, g, beta, *, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                 A_log, dt_bias, lower_bound, safe_gate, summary_precision=None, gate: str = "channel") -> PreparedCall:
    """The :class:`PreparedCall` of already validated FLA-style arguments (``backend_name``: the registered
    backend :func:`choose_call_backend` chose).

    ``gate``: the gate's kind (:data:`~kdacp.backends.base.GATE_KINDS`), carried in the options:
    ``"channel"`` (KDA: ``g [B, T, HV, K]``, ``dt_bias [HV*K]``) or ``"scalar"`` (GDN: ``g [B, T, HV]``,
    ``dt_bias [HV]``), which every backend gets as it is: one whose spec runs the scalar gate
    (:attr:`~kdacp.backends.registry.BackendSpec.runs_scalar_gate`: ``fla``, except for a training call where
    FLA refuses its GDN backward, and ``attn_gym``) on kernels of its own, the others on their per-channel
    kernels, through :class:`kdacp.backends.gate.BroadcastGate`, which broadcasts it
    (:func:`kdacp.backends.gate.build_for_gate`). A call that wants no
    gradient runs on the spec's ``inference`` backend where it names one (``attn_gym``: FLA's kernels, see
    :mod:`kdacp.backends.attn_gym_backend`).
    """
    B, T, _, K = q.shape
    options = KDAOptions(scale=K ** -0.5 if scale is None else float(scale),
                         use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
                         use_gate_in_kernel=bool(use_gate_in_kernel), lower_bound=lower_bound,
                         safe_gate=bool(safe_gate), summary_precision=summary_precision, gate=gate)
    training = wants_gradient(q, k, v, g, beta, A_log, dt_bias)
    spec = BACKEND_SPECS[backend_name]
    if not training and spec.inference is not None:
        spec = BACKEND_SPECS[spec.inference]
    packed = [x if B == 1 else x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    backend = build_for_gate(spec, options, training)
    return PreparedCall(backend, KDAInputs(*packed, A_log, dt_bias), B, T, v.shape[2], v.shape[3])


def choose_call_backend(backend: str, device: torch.device, q, k, v, *, scalar_gate: bool,
                        use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, lower_bound, summary_precision,
                        training: bool = False) -> BackendSpec:
    """The backend of one call, chosen once (:func:`~kdacp.backends.registry.choose_backend` with the call's
    shapes, dtypes and options, so every rank decides alike): under ``"auto"`` a call outside a candidate's
    limits (attention-gym's) runs on the next candidate (``"fla"``).

    Raises:
        ValueError, ImportError: as :func:`~kdacp.backends.registry.choose_backend`; ValueError naming the limit
            when a backend asked for by name refuses the call.
    """
    return choose_backend(backend, device, scalar_gate=scalar_gate, call=CallFacts(
        q, k, v, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        lower_bound=lower_bound, summary_precision=summary_precision, training=training))


def wants_gradient(*tensors) -> bool:
    """Whether autograd would differentiate through any of ``tensors`` (None allowed) here."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def input_dtypes(inputs: KDAInputs) -> tuple:
    """The dtypes of q, k, v, g, beta, A_log, dt_bias (None where absent), for :func:`input_gradients`."""
    return tuple(None if t is None else t.dtype for t in vars(inputs).values())


def input_gradients(grads: LocalGrads, dtypes: tuple) -> tuple:
    """``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias)`` in the inputs' ``dtypes`` (None where an input was None)."""
    out = (grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, grads.dA_log, grads.ddt_bias)
    return tuple(None if d is None or t is None else d.to(t) for d, t in zip(out, dtypes))
