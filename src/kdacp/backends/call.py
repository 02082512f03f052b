"""One call's preparation, shared by the single-device op (``kdacp.chunk_kda``) and the
context-parallel one (``kdacp.chunk_kda``): options, the backend instance, the inputs packed into
one row, and the casting of the gradients back to the inputs' dtypes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import make_backend, resolve_backend
from .attn_gym_adapter import attn_gym_refusal
from .base import KDAInputs, KDAOptions, LocalBackend, LocalGrads
from .fla_adapter import fla_gated_gdn_backward_supported


@dataclass(frozen=True)
class PreparedCall:
    """``backend`` (holding the call's :class:`KDAOptions`), ``inputs``: q, k, v, g, beta packed into one
    row ``[1, B*T, ...]`` (views) with ``A_log``/``dt_bias`` only with the gate in kernel, and the
    ``B, T, HV, V`` the output is shaped back with."""

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
                 A_log, dt_bias, lower_bound, safe_gate, summary_precision=None, scalar_gate=None) -> PreparedCall:
    """The :class:`PreparedCall` of already validated FLA-style arguments (``backend_name`` resolved).

    ``scalar_gate``: for GDN, its own ``(g [B, T, HV], dt_bias [HV] or None)``, of which ``g`` is the
    per-channel broadcast (``dt_bias``: a meta stand-in, :func:`kdacp.gdn.gdn_as_kda_arguments`); the
    ``fla`` backend then runs FLA's GDN kernels on it, the ``torch`` backend the KDA reference on the
    broadcast (``dt_bias`` broadcast here). Where FLA refuses its GDN backward
    (:func:`~kdacp.backends.fla_adapter.fla_gated_gdn_backward_supported`) and a gradient is wanted,
    the ``fla`` backend runs FLA's KDA kernels on the broadcast gate instead (same math, slower). The
    ``attn_gym`` backend runs attention-gym's GDN core on it where a gradient is wanted, and a call that
    wants none on the ``fla`` backend (see :mod:`kdacp.backends.attn_gym_backend`).
    """
    B, T, _, K = q.shape
    options = KDAOptions(scale=K ** -0.5 if scale is None else float(scale),
                         use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
                         use_gate_in_kernel=bool(use_gate_in_kernel), lower_bound=lower_bound,
                         safe_gate=bool(safe_gate), summary_precision=summary_precision)
    training = wants_gradient(q, k, v, g, beta, A_log, dt_bias, *(scalar_gate or ()))
    if backend_name == "attn_gym" and not training:
        # FLA's forward is as fast for KDA and faster for GDN (2.220 / 2.243 ms and 1.148 / 1.832 ms, FLA /
        # attention-gym, 16K tokens, 32 heads of 128, one H200): prefill and inference run on FLA
        backend_name = "fla"
    gdn = scalar_gate is not None and (backend_name == "attn_gym" or backend_name == "fla" and (
        not training or fla_gated_gdn_backward_supported()))
    if gdn:
        g, dt_bias = scalar_gate
    elif scalar_gate is not None and scalar_gate[1] is not None:
        dt_bias = scalar_gate[1].repeat_interleave(K)  # GDN's [HV] over K, as the KDA kernels read it
    packed = [x if B == 1 else x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    return PreparedCall(make_backend(backend_name, options, scalar_gate=gdn), KDAInputs(*packed, A_log, dt_bias), B,
                        T, v.shape[2], v.shape[3])


def call_backend(backend: str, device: torch.device, q, k, v, *, scalar_gate: bool, use_qk_l2norm_in_kernel: bool,
                 use_gate_in_kernel: bool, lower_bound, summary_precision) -> str:
    """The concrete backend of one call: :func:`~kdacp.backends.resolve_backend`'s, except that a call outside
    attention-gym's limits (:func:`~kdacp.backends.attn_gym_adapter.attn_gym_refusal`, from shapes, dtypes and
    options only, so every rank decides alike) runs on ``"fla"`` when ``"attn_gym"`` came from ``"auto"``.

    Raises:
        ValueError, ImportError: as :func:`~kdacp.backends.resolve_backend`; ValueError naming the limit when
            ``backend="attn_gym"`` was asked for by name and the call is outside it.
    """
    name = resolve_backend(backend, device, scalar_gate=scalar_gate)
    if name != "attn_gym":
        return name
    reason = attn_gym_refusal(q, k, v, scalar_gate=scalar_gate, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                              use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
                              summary_precision=summary_precision)
    if reason is None:
        return name
    if backend == "auto":
        return "fla"
    raise ValueError(f"backend='attn_gym' cannot run this call: {reason}")


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
