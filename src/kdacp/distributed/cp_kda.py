"""``cp_chunk_kda``: context-parallel chunk KDA, differentiable, over a :class:`CPPlan`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import resolve_backend
from ..backends.base import KDAInputs, LocalBackend, LocalStates, tensor_fields
from ..backends.call import input_dtypes, input_gradients, prepare_call
from ..reference.gates import compute_dtype
from .checks import check_cp_call
from .orchestration import cp_backward, cp_forward
from .plan import CPPlan

__all__ = ["cp_chunk_kda"]


@dataclass(frozen=True)
class _Call:
    """What backward needs besides tensors."""

    plan: CPPlan
    backend: LocalBackend
    output_final_state: bool
    has_initial_state: bool
    state_dtype: torch.dtype


class CPChunkKDAFunction(torch.autograd.Function):
    """Saves and restores; the work is in :mod:`.orchestration`. Inputs are one packed row."""

    @staticmethod
    def forward(ctx, call: _Call, q, k, v, g, beta, A_log, dt_bias, initial_state):
        inputs = KDAInputs(q, k, v, g, beta, A_log, dt_bias)
        result = cp_forward(call.backend, call.plan, inputs, initial_state, call.output_final_state, call.state_dtype)
        ctx.call, ctx.saved_type = call, type(result.saved)
        kept = result.head_states or LocalStates(None)
        ctx.save_for_backward(result.local_initial, result.transition, kept.h, kept.v_new, *tensor_fields(result.saved))
        ctx.input_dtypes = input_dtypes(inputs)
        return result.o, result.final_state

    @staticmethod
    def backward(ctx, do, dfinal):
        local_initial, transition, h, v_new, *saved = ctx.saved_tensors
        call: _Call = ctx.call
        head_states = None if h is None else LocalStates(None, h, v_new)
        grads = cp_backward(call.backend, call.plan, ctx.saved_type(*saved), local_initial, transition, head_states,
                            do.contiguous(), dfinal, call.output_final_state, call.has_initial_state)
        return (None, *input_gradients(grads, ctx.input_dtypes), grads.dinitial_state)


def cp_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                 lower_bound=None, safe_gate=False, backend="auto", cp=None, check_finite=False, *, _scalar_gate=None):
    """Chunk KDA over tokens split across the ranks of ``cp.group``; call it on every rank.

    Args:
        q, k: this rank's ``[B, T_local, H, K]``; ``v [B, T_local, HV, V]``; ``g [B, T_local, HV, K]``
            (natural-log decay, or raw logits with ``use_gate_in_kernel``); ``beta [B, T_local, HV]``.
            ``B == 1`` when the plan packs sequences.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` for the ``N`` global sequences; each enters at the rank
            holding the sequence's first token (its gradient is returned there; zero elsewhere).
        output_final_state: return every sequence's final state ``[N, HV, K, V]`` on every rank;
            its gradients from all ranks add up at the rank that computed it.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log [HV], dt_bias [HV*K], lower_bound,
            safe_gate: as FLA's ``chunk_kda``. ``A_log``/``dt_bias`` gradients are this rank's share
            (sum them over the group, as for any parameter under context parallelism).
        backend: ``"auto"``, ``"torch"`` or ``"fla"`` (see :mod:`kdacp.backends`).
        cp: the :class:`CPPlan` of this batch (:func:`build_cp_plan`).
        check_finite: raise ``ValueError`` on every rank, before any kernel runs, when any rank's
            q, k, v, g, beta, initial_state (or, with ``use_gate_in_kernel``, A_log, dt_bias) holds a
            NaN or Inf; the message names the rank(s) and argument(s). Costs one reduction per input,
            one small all-gather and one host sync per call (the flag rides in the cross-rank check's
            all-gather, which then runs on every call); pass the same value on every rank. Off by
            default: then a NaN in one sequence of a packed batch reaches that sequence's outputs
            and gradients (and the shared A_log/dt_bias gradients), no other sequence's.
        _scalar_gate: set by :func:`kdacp.cp_chunk_gated_delta_rule` only, as in :func:`kdacp.chunk_kda`.

    Returns:
        ``(o [B, T_local, HV, V] in v's dtype, final_state [N, HV, K, V] or None)``; states are
        float32 (float64 for float64 inputs).

    Raises:
        ValueError: on every rank, when any rank's inputs are invalid (with ``check_finite``, hold NaN
            or Inf) or the ranks disagree on the plan, shapes, dtypes or options (the rank whose
            input is wrong raises its own ``TypeError``/``ValueError``, naming the argument).
    """
    name = check_cp_call(cp, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                         lower_bound=lower_bound, safe_gate=safe_gate, backend=backend,
                         resolve_backend=resolve_backend, check_finite=check_finite)
    prepared = prepare_call(name, q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                            lower_bound=lower_bound, safe_gate=safe_gate, scalar_gate=_scalar_gate)
    call = _Call(cp, prepared.backend, bool(output_final_state), initial_state is not None, compute_dtype(q))
    o, final_state = CPChunkKDAFunction.apply(call, *vars(prepared.inputs).values(), initial_state)
    return prepared.unpack(o), final_state
