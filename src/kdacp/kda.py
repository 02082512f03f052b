"""``chunk_kda``: Kimi Delta Attention on one device with FLA's arguments, differentiable, on a
selectable local backend. Its context-parallel twin is :mod:`kdacp.distributed.cp_kda`; both prepare
the call with :mod:`kdacp.backends.call`."""
from __future__ import annotations

import torch

from .backends import resolve_backend
from .backends.base import KDAInputs, LocalBackend, Span, tensor_fields
from .backends.call import input_dtypes, input_gradients, prepare_call
from .reference.gates import compute_dtype
from .validation import check_finite_inputs, check_kda_inputs

__all__ = ["chunk_kda"]


class ChunkKDAFunction(torch.autograd.Function):
    """Saves and restores; the stages are the backend's. Inputs are one packed row."""

    @staticmethod
    def forward(ctx, backend: LocalBackend, span: Span, output_final_state: bool, q, k, v, g, beta, A_log,
                dt_bias, initial_state):
        chunks = backend.prepare(KDAInputs(q, k, v, g, beta, A_log, dt_bias), span)
        state_dtype = compute_dtype(q)  # states are float32 (float64 for float64 inputs) whatever h0's dtype
        if initial_state is None:
            h0 = torch.zeros(span.num_segments, v.shape[2], q.shape[3], v.shape[3], dtype=state_dtype, device=q.device)
        else:
            h0 = initial_state.to(state_dtype).contiguous()
        states = backend.state_pass(chunks, span, h0, output_final_state)
        o = backend.output(chunks, span, h0, states)
        saved = backend.to_saved(chunks)
        ctx.backend, ctx.span, ctx.saved_type = backend, span, type(saved)
        ctx.has_initial_state = initial_state is not None
        ctx.input_dtypes = input_dtypes(KDAInputs(q, k, v, g, beta, A_log, dt_bias))
        ctx.save_for_backward(h0, *tensor_fields(saved))
        return o, states.final_state

    @staticmethod
    def backward(ctx, do, dht):
        h0, *saved = ctx.saved_tensors
        # Like FLA, the state pass is recomputed rather than kept (memory).
        local = ctx.backend.backward_local(ctx.saved_type(*saved), ctx.span, do.contiguous(), h0)
        states = ctx.backend.backward_states(local, dht)
        grads = input_gradients(ctx.backend.backward_inputs(states), ctx.input_dtypes)
        return (None, None, None, *grads, states.dinitial_state if ctx.has_initial_state else None)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              lower_bound=None, safe_gate=False, cu_seqlens=None, cu_seqlens_cpu=None, backend="auto",
              check_finite=False, *, _scalar_gate=None):
    """Chunk KDA on one device, differentiable.

    Args:
        q, k: ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` (natural-log decay, or raw
            logits with ``use_gate_in_kernel``); beta ``[B, T, HV]``.
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``; ``N = B``, or ``len(cu_seqlens) - 1``.
        output_final_state: also return the final states ``[N, HV, K, V]``.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log [HV], dt_bias [HV*K], lower_bound,
            safe_gate: as FLA's ``chunk_kda``.
        cu_seqlens: ``[N+1]`` int64 boundaries of packed sequences (``B == 1``).
        cu_seqlens_cpu: the same boundaries on the host, as in FLA: with it, ``cu_seqlens`` is not
            read back from the device (no sync); it must hold the same values.
        backend: ``"auto"`` (FLA on CUDA when installed, else torch), ``"torch"`` or ``"fla"``.
        check_finite: raise ``ValueError`` naming the argument (q, k, v, g, beta, initial_state, and
            with ``use_gate_in_kernel`` A_log, dt_bias) that holds a NaN or Inf, before any kernel
            runs. Costs one reduction per input and one host sync per call, so it is off by default.
            When off, non-finite values are not looked for: a NaN in one sequence of a packed batch
            reaches that sequence's outputs and gradients (and the shared A_log/dt_bias gradients),
            no other sequence's.
        _scalar_gate: set by :func:`kdacp.chunk_gated_delta_rule` only: GDN's own ``(g, dt_bias)`` of
            which ``g``/``dt_bias`` here are the broadcast (see :func:`kdacp.backends.call.prepare_call`).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 (float64 for float64) or None)``.

    Raises:
        TypeError, ValueError: invalid inputs (with ``check_finite``, NaN or Inf) or an unknown backend;
        ImportError: ``"fla"`` unusable.
    """
    if cu_seqlens_cpu is not None:
        cu_seqlens = cu_seqlens_cpu  # validated and read on the host; the backends move what they need
    dims = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                            lower_bound=lower_bound)
    if check_finite:
        check_finite_inputs(dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                                 A_log=A_log if use_gate_in_kernel else None,
                                 dt_bias=dt_bias if use_gate_in_kernel else None))
    call = prepare_call(resolve_backend(backend, q.device), q, k, v, g, beta, scale=scale,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, safe_gate=safe_gate,
                        scalar_gate=_scalar_gate)
    B, T = dims.B, dims.T
    cu = [b * T for b in range(B + 1)] if cu_seqlens is None else cu_seqlens.tolist()
    o, final_state = ChunkKDAFunction.apply(call.backend, Span(0, B * T, tuple(cu)), bool(output_final_state),
                                            *vars(call.inputs).values(), initial_state)
    return call.unpack(o), final_state
