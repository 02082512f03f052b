"""``chunk_kda``: Kimi Delta Attention with FLA's arguments, differentiable, on a selectable local
backend; on one device, or context-parallel over the ranks of a :class:`~kdacp.cp.CPPlan`
(``cp=``). One device is the case without a plan: the call runs the same schedule
(:mod:`kdacp.cp.schedule`) on a one-rank plan of its own batch, which exchanges nothing.

Three tiers: :func:`chunk_kda` checks the arguments (across ranks under ``cp``) and prepares the call
(:func:`check_and_prepare`); :func:`run_prepared` runs a prepared call (the entry GDN's op takes with
its own gate); :class:`ChunkKDAFunction` only saves and restores.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..backends.base import KDAInputs, LocalBackend, LocalStates, tensor_fields
from ..backends.call import (PreparedCall, choose_call_backend, input_dtypes, input_gradients, prepare_call,
                            wants_gradient)
from ..cp.batch_context import CPContext
from ..cp.checks import check_cp_call
from ..cp.schedule import cp_backward, cp_forward
from ..cp.plan import CPPlan, one_rank_plan
from ..cp.split import SplitPieces, check_split
from ..host_copies import host_boundaries
from ..kernels.precision import resolve_precision
from ..reference.gates import compute_dtype
from ..validation import check_finite_inputs, check_fla_only_options, check_kda_inputs


@dataclass(frozen=True)
class _Call:
    """What backward needs besides tensors."""

    plan: CPPlan
    backend: LocalBackend
    output_final_state: bool
    has_initial_state: bool
    split: object = None


class ChunkKDAFunction(torch.autograd.Function):
    """Saves and restores; the work is in :mod:`kdacp.cp.schedule`. Inputs are one packed row."""

    @staticmethod
    def forward(ctx, call: _Call, q, k, v, g, beta, A_log, dt_bias, initial_state):
        inputs = KDAInputs(q, k, v, g, beta, A_log, dt_bias)
        # states are float32 (float64 for float64 inputs) whatever initial_state's dtype
        result = _forward(call, inputs, initial_state)
        if any(ctx.needs_input_grad):  # nothing to keep for inference (host time, and the saved tensors)
            ctx.call, ctx.saved_type = call, type(result.saved)
            kept = result.head_states or LocalStates(None)
            split = result.split
            ctx.split_cut = None if split is None else (split.starts, split.counts)
            ctx.save_for_backward(result.local_initial, result.transition, kept.h, kept.v_new,
                                  None if split is None else split.entries,
                                  None if split is None else split.transitions, *tensor_fields(result.saved))
            ctx.input_dtypes = input_dtypes(inputs)
        return result.o, result.final_state

    @staticmethod
    def backward(ctx, do, dfinal):
        local_initial, transition, h, v_new, split_entries, split_transitions, *saved = ctx.saved_tensors
        call: _Call = ctx.call
        head_states = None if h is None else LocalStates(None, h, v_new)
        split = None if ctx.split_cut is None else SplitPieces(*ctx.split_cut, split_entries, split_transitions)
        # Like FLA, the state pass is recomputed rather than kept (memory), except where a predecessor waits for
        # a gradient that follows the rank's local pass: the whole rank is one head, or it holds several positions.
        grads = cp_backward(call.backend, call.plan, ctx.saved_type(*saved), local_initial, transition, head_states,
                            do.contiguous(), dfinal, call.output_final_state, call.has_initial_state, split=split)
        return (None, *input_gradients(grads, ctx.input_dtypes), grads.dinitial_state)


def _forward(call: _Call, inputs: KDAInputs, initial_state):
    # states are float32 (float64 for float64 inputs) whatever initial_state's dtype
    return cp_forward(call.backend, call.plan, inputs, initial_state, call.output_final_state, compute_dtype(inputs.q),
                      split=call.split)


def _from_context(cp, cu_seqlens, cu_seqlens_cpu):
    """``(plan, context)`` of a call given ``cp``: a :class:`~kdacp.cp.CPContext` gives its plan, or on one device its
    one-rank plan of the local batch and itself (``context``: the call's inputs are then checked against it, not its
    boundaries again); a :class:`~kdacp.cp.CPPlan` or None is passed through (``context`` None). With a context the
    call's own ``cu_seqlens`` and ``cu_seqlens_cpu`` must be None: the context holds the boundaries."""
    if not isinstance(cp, CPContext):
        return cp, None
    if cu_seqlens is not None or cu_seqlens_cpu is not None:
        raise ValueError("with cp a CPContext, pass neither cu_seqlens nor cu_seqlens_cpu: the context holds the "
                         "batch's boundaries")
    if cp.plan is not None:
        return cp.plan, None
    if cp.group is not None:
        raise ValueError("cp is a CPContext built without a plan (with_plan=False, for softmax attention); build it "
                         "with with_plan=True for the recurrence")
    return cp.local_plan, cp


def check_and_prepare(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                      A_log, dt_bias, lower_bound, safe_gate, cu_seqlens, cu_seqlens_cpu, backend, check_finite,
                      output_final_state, cp, summary_precision=None,
                      gate: str = "channel") -> tuple[PreparedCall, CPPlan]:
    """Check :func:`chunk_kda`'s arguments (on every rank of ``cp.group`` alike under ``cp``) and return
    the :class:`~kdacp.backends.call.PreparedCall` and the plan to run it on (``cp``'s, or the one-rank
    plan of the call's own batch). ``gate``: the gate's kind, ``"scalar"`` for GDN's ``g [B, T, HV]`` and
    ``dt_bias [HV]`` (see :func:`~kdacp.backends.call.prepare_call`). Raises as :func:`chunk_kda`."""
    options = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                   safe_gate=safe_gate, summary_precision=summary_precision)
    # the backend, chosen once by the call's shapes, dtypes and options (auto: attention-gym's cores within
    # their limits); under cp inside the cross-rank check, so that every rank raises alike
    choose = functools.partial(choose_call_backend, q=q, k=k, v=v, scalar_gate=gate == "scalar",
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
                               summary_precision=summary_precision,
                               training=wants_gradient(q, k, v, g, beta, A_log, dt_bias))
    cp, context = _from_context(cp, cu_seqlens, cu_seqlens_cpu)
    if context is not None or cp is None:
        if cu_seqlens_cpu is not None:
            cu_seqlens = cu_seqlens_cpu  # validated and read on the host; the backends move what they need
        dims = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                                lower_bound=lower_bound, gate=gate,
                                sequences=None if context is None else cp.num_sequences)
        if check_finite:
            check_finite_inputs(dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                                     A_log=A_log if use_gate_in_kernel else None,
                                     dt_bias=dt_bias if use_gate_in_kernel else None))
        if context is not None and (dims.B, dims.T) != (cp.batch_size, cp.local_lengths[0]):
            raise ValueError(f"q has B={dims.B}, T={dims.T}, but the context cp holds {cp.num_sequences} "
                             f"sequence(s) of {cp.local_lengths[0]} local tokens in B={cp.batch_size} row(s): pass "
                             "this batch's context")
        name = choose(backend, q.device).name
        resolve_precision(summary_precision, q.dtype, name="summary_precision")
        plan = cp if context is not None else \
            one_rank_plan(None if cu_seqlens is None else host_boundaries(cu_seqlens), dims.B, dims.T)
    else:
        name = check_cp_call(cp, q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                             backend=backend, resolve_backend=lambda b, d: choose(b, d).name,
                             check_finite=check_finite,
                             cu_seqlens=cu_seqlens if cu_seqlens is not None else cu_seqlens_cpu, gate=gate,
                             **options)
        plan = cp
    return prepare_call(name, q, k, v, g, beta, gate=gate, **options), plan


def run_prepared(prepared: PreparedCall, plan: CPPlan, initial_state, output_final_state: bool, split=None):
    """Run a call from :func:`check_and_prepare` on ``plan``; returns what :func:`chunk_kda` returns.
    ``split``: as :func:`chunk_kda`'s, checked."""
    call = _Call(plan, prepared.backend, bool(output_final_state), initial_state is not None, split)
    tensors = (*vars(prepared.inputs).values(), initial_state)
    if wants_gradient(*tensors):
        o, final_state = ChunkKDAFunction.apply(call, *tensors)
    else:  # nothing to differentiate: no autograd wrapper (its host time, about 10 us a call on a CPU core)
        result = _forward(call, prepared.inputs, initial_state)
        o, final_state = result.o, result.final_state
    return prepared.unpack(o), final_state


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              lower_bound=None, safe_gate=False, cu_seqlens=None, cu_seqlens_cpu=None, backend="auto",
              check_finite=False, cp=None, summary_precision=None, split="auto", use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False):
    """Chunk KDA, differentiable: on one device, or with ``cp`` over the tokens split across the ranks
    of ``cp.group`` (then call it on every rank, each with its own tokens).

    Args:
        q, k: ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` (natural-log decay, or raw
            logits with ``use_gate_in_kernel``); beta ``[B, T, HV]``. Under ``cp``: this rank's
            ``T_local`` tokens in the plan's layout (its ranges of each row or of the packed stream,
            concatenated in ascending order; ``cp.layout``), and ``B == 1`` when the plan packs sequences.
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``; ``N = B``, or the number of (global) sequences. Under ``cp``
            each enters at the rank holding the sequence's first token (its gradient is returned
            there; zero elsewhere).
        output_final_state: also return the final states ``[N, HV, K, V]``; under ``cp`` on every
            rank, their gradients from all ranks adding up at the rank that computed each.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log [HV], dt_bias [HV*K], lower_bound,
            safe_gate: as FLA's ``chunk_kda``. Under ``cp`` the ``A_log``/``dt_bias`` gradients are
            this rank's share (sum them over the group, as for any parameter).
        cu_seqlens: ``[N+1]`` int64 boundaries of packed sequences (``B == 1``), one device only
            (under ``cp`` the plan holds the global boundaries); read back from the device once per tensor
            (one sync; later calls with the same unchanged tensor read nothing).
        cu_seqlens_cpu: the same boundaries on the host, as in FLA: with it, ``cu_seqlens`` is not
            read back from the device (no sync); it must hold the same values.
        backend: ``"auto"`` (on CUDA: attention-gym's cores for training on a Hopper GPU where installed and
            within their limits, else FLA when installed; else torch), ``"torch"``, ``"fla"`` or ``"attn_gym"``
            (:mod:`kdacp.backends`).
        check_finite: raise ``ValueError`` naming the argument (q, k, v, g, beta, initial_state, and
            with ``use_gate_in_kernel`` A_log, dt_bias) that holds a NaN or Inf, before any kernel
            runs. Costs one reduction per input and one host sync per call, so it is off by default.
            Under ``cp`` every rank raises and the message names the rank(s); the flag rides in the
            cross-rank check's all-gather, which then runs on every call; pass the same value on
            every rank. When off, non-finite values are not looked for: a NaN in one sequence of a
            packed batch reaches that sequence's outputs and gradients (and the shared
            A_log/dt_bias gradients), no other sequence's.
        cp: this batch's :class:`~kdacp.cp.CPContext` (:func:`kdacp.cp.build_cp_context`: its plan, or on one
            device its local boundaries, host and device, read without a sync; ``cu_seqlens`` and
            ``cu_seqlens_cpu`` then stay None), or its :class:`~kdacp.cp.CPPlan` alone
            (:func:`kdacp.build_cp_plan`), or ``None`` for one device.
        summary_precision: how the ``fla`` backend's summary kernels (the state exchange of ``cp``) round
            their float32 state products with bf16 inputs: ``"exact"`` (float32-faithful), ``"two_piece"``,
            ``"mixed"`` or ``"one_piece"`` (FLA's own state pass's precision), see
            :class:`kdacp.kernels.SummaryPrecision`; ``None``: the default for the inputs' dtype (fp16 and
            float32 inputs always run float32 products; the ``torch`` backend computes summaries in float32).
            Under ``cp`` every rank must pass the same value.
        split: the split inside the device (:mod:`kdacp.cp.split`): each long sequence (under ``cp``:
            each long local segment of a rank that runs its state pass whole) cut into pieces whose state passes
            run at once, from states carried between them by their summaries, forward and backward; exact to
            the summaries' precision (``summary_precision``). ``"auto"`` (default): on a GPU, where the longest
            sequence holds at least 16K tokens and the pieces that fill the GPU cut it at least 4 times (few
            heads, long sequences; :func:`kdacp.cp.split.auto_chunks_per_piece`), else no cut; ``None`` or 1: no
            cut; an int ``S``: the longest sequence in ``S`` pieces. Ranks may differ. On one H100 at 64K
            tokens, one sequence, ``"auto"`` ran KDA's forward in 0.82-0.94x of FLA's op at 2-8 heads and its
            forward + backward in 0.87-0.90x at 4-8 heads (1.07x at 2 heads in that run, 0.85x in an earlier
            one); at 32 heads, and on a packed batch of 64K tokens, it declines the cut, within 1% of no cut
            (benchmarks/RESULTS.md, Split inside one GPU). Known failure: a cut call's forward + backward captured in
            a CUDA graph failed on an H100 (torch 2.11; RESULTS, GPU tests), so ``"auto"`` never cuts inside a
            capture and an int must not be captured.
        use_beta_sigmoid_in_kernel, allow_neg_eigval: FLA's names, taken at FLA's default only (False; True
            raises ``ValueError``): ``beta`` is the write strength in ``[0, 1]``, after its sigmoid.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 (float64 for float64) or None)``.

    Raises:
        TypeError, ValueError: invalid inputs (with ``check_finite``, NaN or Inf) or an unknown backend;
            under ``cp`` on every rank, also when the ranks disagree on the plan, shapes, dtypes or
            options (the rank whose input is wrong raises its own error, naming the argument).
        ImportError: ``"fla"`` or ``"attn_gym"`` unusable (the message names the missing package).
    """
    # before the cross-rank check: a bad value raises on its own rank, before any rank waits
    check_fla_only_options(use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    check_split(split)
    prepared, plan = check_and_prepare(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        safe_gate=safe_gate, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, backend=backend,
        check_finite=check_finite, output_final_state=output_final_state, cp=cp, summary_precision=summary_precision)
    return run_prepared(prepared, plan, initial_state, output_final_state, split)
