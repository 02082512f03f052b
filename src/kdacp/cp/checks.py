"""Cross-rank input checks: a bad or mismatched input raises on every rank instead of hanging.

Each rank validates its own arguments, then all ranks exchange one small int64 signature in a
single all-gather; every rank raises ``ValueError`` if any rank failed or the ranks disagree. A
signature verified on a plan is not exchanged again (unless the plan checks every call): the memo
lives here, not in the (frozen) plan, and is dropped with the plan.
"""
from __future__ import annotations

import struct
import zlib
import weakref

import torch
import torch.distributed as dist

from ..kernels.precision import SummaryPrecision, resolve_precision
from ..validation import check_kda_dtypes, check_kda_inputs, check_tensor, nonfinite_mask, nonfinite_names
from . import collectives
from .plan import CPPlan

# The call signatures every rank has verified, per plan object (a new plan always checks again); an
# entry goes with its plan.
_VERIFIED: dict[int, set] = {}


def verified_plans() -> int:
    """The plans whose verified call signatures are kept now (each entry is freed with its plan)."""
    return len(_VERIFIED)


def _verified(plan: CPPlan) -> set:
    key = id(plan)
    if key not in _VERIFIED:
        weakref.finalize(plan, _VERIFIED.pop, key, None)
        _VERIFIED[key] = set()
    return _VERIFIED[key]

_DTYPES = (None, torch.float64, torch.float32, torch.bfloat16, torch.float16)
_OTHER = len(_DTYPES)  # the code of any other dtype

# Fields every rank must agree on, in signature order (after the leading "ok" flag).
_FIELDS = ("plan", "B", "T_local (equal split)", "H", "HV", "K", "V", "q/k dtype", "v dtype", "g dtype",
           "beta dtype", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
           "A_log", "dt_bias", "lower_bound", "safe_gate", "scale", "backend", "check_finite", "summary_precision")


def _float_bits(x) -> int:
    return 0 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(bits: int) -> str:
    return "None" if bits == 0 else repr(struct.unpack("<d", struct.pack("<q", bits))[0])


def _dtype_code(*xs) -> int:
    """The dtypes of ``xs`` (None for a non-tensor) as one int, a base ``_OTHER + 1`` digit each."""
    code = 0
    for x in xs:
        dtype = getattr(x, "dtype", None)
        code = code * (_OTHER + 1) + (_DTYPES.index(dtype) if dtype in _DTYPES else _OTHER)
    return code


def _dtype_names(code: int, n: int) -> str:
    """The ``n`` dtypes of a :func:`_dtype_code`, one name when they are all alike, else joined by ``/``."""
    names = []
    for _ in range(n):
        code, digit = divmod(code, _OTHER + 1)
        names.insert(0, "another dtype" if digit == _OTHER else str(_DTYPES[digit]))
    return names[0] if len(set(names)) == 1 else "/".join(names)


# How a disagreement shows each field's values (the rest are printed as the ints they are).
_PRECISION_NAMES = {zlib.crc32(p.value.encode()): p.value for p in SummaryPrecision}
_SHOW = {"q/k dtype": lambda c: _dtype_names(c, 2), "lower_bound": _bits_float, "scale": _bits_float,
         "summary_precision": lambda c: _PRECISION_NAMES.get(c, "?"),
         **{f: lambda c: _dtype_names(c, 1) for f in ("v dtype", "g dtype", "beta dtype", "initial_state",
                                                      "A_log", "dt_bias")}}


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def plan_difference(descriptions: list) -> str:
    """Where the ranks' plans differ, from every rank's :attr:`CPPlan.description` (in rank order): the first
    entry that differs and each rank's value there; for a sequence (``cu_seqlens``, ``local_lengths``, the
    layout's ranges) the first index at which the ranks differ and each rank's value at it."""
    for pairs in zip(*descriptions):
        name, values = pairs[0][0], [value for _, value in pairs]
        if all(value == values[0] for value in values):
            continue
        if all(isinstance(value, (tuple, list)) for value in values):
            i = next(i for i in range(max(map(len, values)))
                     if len({repr(v[i]) if i < len(v) else None for v in values}) > 1)
            shown = ", ".join(f"rank {r}: {_short(v[i]) if i < len(v) else f'none (length {len(v)})'}"
                              for r, v in enumerate(values))
            return f"{name} differ first at index {i} ({shown})"
        return f"{name} by rank [{', '.join(_short(v) for v in values)}]"
    return "the plans' descriptions agree but their fingerprints differ"


def check_rank_call(plan: CPPlan, q, k, v, g, beta, initial_state, use_gate_in_kernel, A_log, dt_bias,
                    lower_bound, cu_seqlens, gate: str = "channel"):
    """This rank's own part of :func:`check_cp_call` (no collective, dtypes aside): shapes, ``T_local`` against
    the plan's layout, ``initial_state [N, HV, K, V]``, no ``cu_seqlens``; returns the sizes
    (:class:`~kdacp.validation.KDADims`). Raises ``ValueError`` naming the argument."""
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens must be None with cp: the plan holds the global boundaries "
                         "(build_cp_plan(cu_seqlens, ...))")
    # The dtypes are checked once the ranks agree on them (they are in the signature), so a mix
    # that one rank passes shows as a disagreement on every rank.
    dims = check_kda_inputs(q, k, v, g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                            dt_bias=dt_bias, lower_bound=lower_bound, dtypes=False, gate=gate)
    if plan.cu_seqlens is not None and dims.B != 1:
        raise ValueError(f"the plan packs sequences (cu_seqlens), so q must have B=1, got q {tuple(q.shape)}")
    if plan.cu_seqlens is None and dims.B != plan.batch_size:
        raise ValueError(f"the plan has batch_size={plan.batch_size} but q has B={dims.B}")
    expected = plan.lengths_for(dims.T)[plan.rank]
    if dims.T != expected:
        raise ValueError(f"rank {plan.rank} holds {expected} tokens in the plan's layout (layout.local_lengths"
                         f"[{plan.rank}]) but q has T_local={dims.T}: pass the rank's ranges' tokens, concatenated")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, 4)
        want = (plan.num_sequences, dims.HV, dims.K, dims.V)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must have shape [N, HV, K, V] = {want} (N global sequences), "
                             f"got {tuple(initial_state.shape)}")
    return dims


def check_cp_call(plan: CPPlan, q, k, v, g, beta, *, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
                  backend: str, resolve_backend, check_finite: bool = False, cu_seqlens=None,
                  summary_precision=None, gate: str = "channel") -> str:
    """Validate one ``chunk_kda`` call on every rank; return the resolved backend name.

    ``resolve_backend(backend, device)`` maps the requested backend to a concrete one and may raise.
    ``cu_seqlens``: must be None (the plan holds the boundaries); a rank that passes it fails.
    ``check_finite``: also raise (on every rank) when any rank's q, k, v, g, beta, initial_state,
    A_log or dt_bias holds a NaN or Inf; the flag travels in the same all-gather, which then runs
    on every call. ``summary_precision``: a :class:`~kdacp.kernels.SummaryPrecision` name or None,
    resolved for q's dtype; the ranks must agree on the result. ``gate``: the gate's kind
    (:data:`~kdacp.backends.base.GATE_KINDS`), ``"scalar"`` for GDN's ``g [B, T, HV]``.

    Raises:
        ValueError (on every rank): a rank rejected its inputs, the ranks disagree, or (with
            ``check_finite``) a rank's inputs hold NaN or Inf (the message names rank and argument).
        TypeError (on every rank): the ranks agree on dtypes that :func:`check_kda_dtypes` rejects.
    """
    if not isinstance(plan, CPPlan):
        raise TypeError(f"cp must be a CPContext (kdacp.build_cp_context) or a CPPlan (kdacp.build_cp_plan), got "
                        f"{type(plan).__name__} (a ContextParallel is the layers' mode: pass it to a layer's cp, "
                        "e.g. KimiDeltaAttention(..., cp=...), or take its batch's context: cp.context(...))")
    error, dims, name, precision = None, None, "", ""
    try:
        dims = check_rank_call(plan, q, k, v, g, beta, initial_state, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                               cu_seqlens, gate)
        name = resolve_backend(backend, q.device)
        precision = resolve_precision(summary_precision, q.dtype, name="summary_precision").value
    except (TypeError, ValueError, ImportError) as e:
        error = e
    ok = error is None
    open_split = plan.local_lengths is None
    sizes = (dims.B, dims.T if open_split else 0, dims.H, dims.HV, dims.K, dims.V) if ok else (0,) * 6
    signature = [int(ok), plan.signature, *sizes, _dtype_code(q, k), _dtype_code(v), _dtype_code(g), _dtype_code(beta),
                 _dtype_code(initial_state), int(bool(output_final_state)), int(bool(use_qk_l2norm_in_kernel)),
                 int(bool(use_gate_in_kernel)), _dtype_code(A_log), _dtype_code(dt_bias), _float_bits(lower_bound),
                 int(bool(safe_gate)), _float_bits(scale), zlib.crc32(str(name).encode()), int(bool(check_finite)),
                 zlib.crc32(precision.encode())]
    if ok and not check_finite and not plan.check_every_call and tuple(signature) in _verified(plan):
        return name  # every rank agreed on this signature before: no collective, no host sync
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(plan.group) == "nccl" \
        else torch.device("cpu")
    finite = torch.zeros((), dtype=torch.int64)  # always sent, so rows have one length whatever the ranks pass
    if check_finite and ok:  # a flag computed on the device, read back with the signatures (no extra sync)
        finite = nonfinite_mask(dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                                     A_log=A_log if use_gate_in_kernel else None,
                                     dt_bias=dt_bias if use_gate_in_kernel else None))
    rows = collectives.all_gather_signatures(signature, plan.group, device, finite)
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if not row[0]]
    if failed:
        raise ValueError(f"chunk_kda: rank(s) {failed} rejected their inputs (see the error raised there); "
                         f"every rank stops here instead of waiting")
    for i, field in enumerate(_FIELDS, start=1):
        values = [row[i] for row in rows]
        if field == "plan" and len(set(values)) > 1:
            # every rank saw the same rows, so every rank takes part in this second gather
            raise ValueError(f"chunk_kda: ranks disagree on plan: "
                             f"{plan_difference(collectives.all_gather_objects(plan.description, plan.group))}; "
                             "every rank must pass the same plan (build_cp_plan with the same arguments)")
        if len(set(values)) > 1:
            shown = ", ".join(_SHOW.get(field, str)(v) for v in values)
            raise ValueError(f"chunk_kda: ranks disagree on {field}: values by rank [{shown}]; every rank must "
                             "pass the same plan, shapes (except T_local), dtypes and options")
    check_kda_dtypes(q, k, v, g, beta)
    if check_finite:
        bad = [(r, nonfinite_names(row[-1])) for r, row in enumerate(rows) if row[-1]]
        if bad:
            where = "; ".join(f"rank {r}: {', '.join(names)}" for r, names in bad)
            raise ValueError(f"chunk_kda: NaN or Inf in the inputs ({where}) (check_finite=True); every rank "
                             "stops here instead of waiting")
    _verified(plan).add(tuple(signature))
    return name
