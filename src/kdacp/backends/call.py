"""One call's preparation, shared by the single-device op (``kdacp.chunk_kda``) and the
context-parallel one (``kdacp.chunk_kda``): the backend chosen once (:func:`choose_call_backend`), options, the
backend instance, the inputs packed into
one row, and the casting of the gradients back to the inputs' dtypes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import KDAInputs, KDAOptions, LocalBackend, LocalGrads
from .registry import BACKEND_SPECS, BackendSpec, CallFacts, choose_backend


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
    """The :class:`PreparedCall` of already validated FLA-style arguments (``backend_name``: the registered
    backend :func:`choose_call_backend` chose).

    ``scalar_gate``: for GDN, its own ``(g [B, T, HV], dt_bias [HV] or None)``, of which ``g`` is the
    per-channel broadcast (``dt_bias``: a meta stand-in, :func:`kdacp.gdn.gdn_as_kda_arguments`); a backend
    whose spec runs the scalar gate (:attr:`~kdacp.backends.registry.BackendSpec.runs_scalar_gate`: ``fla``,
    except for a training call where FLA refuses its GDN backward, and ``attn_gym``) gets it, the others the
    broadcast (``dt_bias`` broadcast here). A call that wants no gradient runs on the spec's ``inference``
    backend where it names one (``attn_gym``: FLA's kernels, see :mod:`kdacp.backends.attn_gym_backend`).
    """
    B, T, _, K = q.shape
    options = KDAOptions(scale=K ** -0.5 if scale is None else float(scale),
                         use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
                         use_gate_in_kernel=bool(use_gate_in_kernel), lower_bound=lower_bound,
                         safe_gate=bool(safe_gate), summary_precision=summary_precision)
    training = wants_gradient(q, k, v, g, beta, A_log, dt_bias, *(scalar_gate or ()))
    spec = BACKEND_SPECS[backend_name]
    if not training and spec.inference is not None:
        spec = BACKEND_SPECS[spec.inference]
    gdn = scalar_gate is not None and spec.runs_scalar_gate(training)
    if gdn:
        g, dt_bias = scalar_gate
    elif scalar_gate is not None and scalar_gate[1] is not None:
        dt_bias = scalar_gate[1].repeat_interleave(K)  # GDN's [HV] over K, as the KDA kernels read it
    packed = [x if B == 1 else x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    return PreparedCall(spec.build(options, gdn), KDAInputs(*packed, A_log, dt_bias), B, T, v.shape[2], v.shape[3])


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
