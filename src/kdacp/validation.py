"""Input checks shared by every public KDA entry point.

Each check raises ``TypeError`` or ``ValueError`` naming the argument and what was expected,
before any computation runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .host_copies import host_boundaries


@dataclass(frozen=True)
class KDADims:
    """Sizes of one KDA call: batch ``B``, tokens ``T``, q/k heads ``H``, value heads ``HV``,
    key dim ``K``, value dim ``V`` and number of sequences ``N`` (``B``, or ``len(cu_seqlens) - 1``)."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int


def check_tensor(name: str, x, ndim: int | None = None, floating: bool = True) -> None:
    """Raise unless ``x`` is a tensor of ``ndim`` dims with a floating dtype (when ``floating``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def check_positive_int(name: str, value) -> None:
    """Raise ``TypeError`` unless ``value`` is an int (not a bool), ``ValueError`` unless it is >= 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_layer_sizes(*, hidden_size, num_heads, num_v_heads, head_k_dim, head_v_dim, conv_size) -> None:
    """Check a delta-rule layer's sizes: each a positive int, ``num_v_heads`` (``HV``) a multiple of
    ``num_heads`` (``H``)."""
    for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_v_heads", num_v_heads),
                        ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim), ("conv_size", conv_size)):
        check_positive_int(name, value)
    if num_v_heads % num_heads:
        raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_heads={num_heads}")


def check_hidden_states(x, hidden_size: int, dtype: torch.dtype, cu_seqlens=None) -> None:
    """Check a layer's input ``x [B, T, hidden_size]``: a tensor of the layer's parameter ``dtype`` (any floating
    dtype under autocast), ``B == 1`` with ``cu_seqlens``. No host sync."""
    check_tensor("hidden_states", x, 3)
    if x.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states must have shape [B, T, hidden_size={hidden_size}], got {tuple(x.shape)}")
    if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"hidden_states has dtype {x.dtype} but the layer's parameters have {dtype}: "
                        f"cast one to the other (or run under autocast)")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch size B must be 1 (packed sequences), got hidden_states "
                         f"{tuple(x.shape)}")


def check_boundaries(cu: list[int] | tuple[int, ...], T: int) -> None:
    """Check the host values of ``cu_seqlens``: starting at 0, strictly increasing, ending at ``T``."""
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if any(b <= a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing, got {list(cu)}")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens[-1] must equal T={T} (the number of tokens), got {cu[-1]}")


def check_fla_only_options(*, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False) -> None:
    """FLA's options that kdacp takes by name and runs at FLA's default only (False): raise ``ValueError`` for
    True, saying what to pass instead. ``use_beta_sigmoid_in_kernel=True`` (beta given as logits) and
    ``allow_neg_eigval=True`` (FLA's ``beta = 2 * sigmoid(logits)`` in ``[0, 2)``) are not run by kdacp's kernels."""
    for name, value in (("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                        ("allow_neg_eigval", allow_neg_eigval)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if use_beta_sigmoid_in_kernel:
        raise ValueError("use_beta_sigmoid_in_kernel=True is not supported: pass beta = sigmoid(logits) (float32) "
                         "with use_beta_sigmoid_in_kernel=False")
    if allow_neg_eigval:
        raise ValueError("allow_neg_eigval=True (beta in [0, 2)) is not supported: kdacp runs beta in [0, 1] only; "
                         "pass allow_neg_eigval=False")


def check_cu_seqlens(cu_seqlens, B: int, T: int) -> int:
    """Validate ``cu_seqlens`` ``[N+1]`` (int, starting at 0, strictly increasing, ending at ``T``,
    ``B == 1``) and return ``N``."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int64, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"cu_seqlens must have dtype int64 (or int32), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have shape [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size B must be 1 (packed sequences), got B={B}")
    cu = host_boundaries(cu_seqlens)
    check_boundaries(cu, T)
    return len(cu) - 1


def check_kda_dtypes(q, k, v, g, beta) -> None:
    """Raise ``TypeError`` unless ``q, k, v`` share one dtype, ``g`` has it too or is float32 with bfloat16 or
    float16 ``q`` (FLA's gate kernels return float32 decays; every backend accumulates the gate in float32, so a
    float32 ``g`` is used as given), and ``beta`` has it or is float32 or wider (FLA's layer passes float32
    ``beta`` with bfloat16 inputs)."""
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}; q, k and v must share one dtype")
    if g.dtype != q.dtype and not (g.dtype == torch.float32 and q.dtype in (torch.bfloat16, torch.float16)):
        raise TypeError(f"g has dtype {g.dtype} but q has {q.dtype}; g must have q's dtype, or float32 with "
                        f"bfloat16 or float16 q")
    wide = beta.dtype in (torch.float32, torch.float64) and beta.dtype.itemsize >= q.dtype.itemsize
    if beta.dtype != q.dtype and not wide:
        raise TypeError(f"beta has dtype {beta.dtype} but q has {q.dtype}; beta must have q's dtype, or float32 "
                        f"or wider")


def check_kda_inputs(
    q, k, v, g, beta, *, initial_state=None, cu_seqlens=None, use_gate_in_kernel: bool = False,
    A_log=None, dt_bias=None, lower_bound=None, chunk_size: int | None = None, dtypes: bool = True,
    gate: str = "channel", sequences: int | None = None,
) -> KDADims:
    """Check the FLA-layout KDA arguments and return their sizes.

    Expected: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``beta [B, T, HV]``,
    ``HV % H == 0``, ``initial_state [N, HV, K, V]``; with ``use_gate_in_kernel``, ``A_log [HV]``
    and ``dt_bias [HV*K]`` (optional); ``lower_bound`` in [-5, 0); the dtypes as
    :func:`check_kda_dtypes` (unless ``dtypes=False``: the caller checks them itself). ``gate="scalar"``
    (GDN's gate, :data:`~kdacp.backends.base.GATE_KINDS`): ``g [B, T, HV]`` and ``dt_bias [HV]`` instead.
    ``sequences``: the number ``N`` of packed sequences whose boundaries were checked already (a per-batch
    context's; ``cu_seqlens`` then None), for ``initial_state``'s shape.
    """
    scalar = gate == "scalar"
    for name, x, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3 if scalar else 4), ("beta", beta, 3)):
        check_tensor(name, x, nd)
    B, T, H, K = q.shape
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"k must have the shape of q [B, T, H, K] = {(B, T, H, K)}, got {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must have shape [B, T, HV, V] with B, T = {(B, T)}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if T < 1 or H < 1 or K < 1 or V < 1:
        raise ValueError(f"q and v must be non-empty, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if HV % H != 0:
        raise ValueError(f"the value heads HV={HV} (v.shape[2]) must be a multiple of the q/k heads H={H}")
    if scalar and tuple(g.shape) != (B, T, HV):
        raise ValueError(f"g must have shape [B, T, HV] = {(B, T, HV)} (one decay per value head and token), "
                         f"got {tuple(g.shape)}")
    if not scalar and tuple(g.shape) != (B, T, HV, K):
        raise ValueError(f"g must have shape [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must have shape [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share a device")
    if dtypes:
        check_kda_dtypes(q, k, v, g, beta)
    N = check_cu_seqlens(cu_seqlens, B, T) if cu_seqlens is not None else B if sequences is None else sequences
    if initial_state is not None:
        check_tensor("initial_state", initial_state, 4)
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must have shape [N, HV, K, V] = {(N, HV, K, V)}, got {tuple(initial_state.shape)}")
    if lower_bound is not None:
        if not isinstance(lower_bound, (int, float)) or isinstance(lower_bound, bool) or not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound must be a float in [-5, 0), got {lower_bound!r}")
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log of shape [HV] (or a lower_bound)")
        if A_log is not None:
            check_tensor("A_log", A_log)
            if A_log.numel() != HV or A_log.dim() != 1:
                raise ValueError(f"A_log must have shape [HV] = [{HV}], got {tuple(A_log.shape)}")
        if dt_bias is not None and scalar:
            check_tensor("dt_bias", dt_bias)
            if tuple(dt_bias.shape) != (HV,):
                raise ValueError(f"dt_bias must have shape [HV] = [{HV}], got {tuple(dt_bias.shape)}")
        elif dt_bias is not None:
            check_tensor("dt_bias", dt_bias)
            if dt_bias.numel() != HV * K or dt_bias.dim() != 1:
                raise ValueError(f"dt_bias must have shape [HV*K] = [{HV * K}], got {tuple(dt_bias.shape)}")
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    return KDADims(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N)


# The arguments ``check_finite=True`` inspects, in the bit order of :func:`nonfinite_mask`.
FINITE_CHECKED = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def nonfinite_mask(tensors: dict) -> torch.Tensor:
    """An int64 scalar on the inputs' device, bit ``i`` set when ``tensors[FINITE_CHECKED[i]]`` holds
    a NaN or Inf (absent or None entries count as finite). Computed on the device: no host sync."""
    mask = None
    for i, name in enumerate(FINITE_CHECKED):
        x = tensors.get(name)
        if x is None:
            continue
        bit = (~torch.isfinite(x.detach())).any().to(torch.int64) << i
        mask = bit if mask is None else mask | bit.to(mask.device)
    return torch.zeros((), dtype=torch.int64) if mask is None else mask


def nonfinite_names(mask: int) -> list[str]:
    """The argument names whose bits are set in a :func:`nonfinite_mask` value."""
    return [name for i, name in enumerate(FINITE_CHECKED) if mask >> i & 1]


def check_finite_inputs(tensors: dict, where: str = "chunk_kda") -> None:
    """Raise ``ValueError`` naming every argument of ``tensors`` (names from :data:`FINITE_CHECKED`)
    that holds a NaN or Inf. Costs one host sync (it reads one flag back from the device)."""
    bad = nonfinite_names(int(nonfinite_mask(tensors).item()))
    if bad:
        raise ValueError(f"{where}: {', '.join(bad)} hold{'s' if len(bad) == 1 else ''} NaN or Inf "
                         f"(check_finite=True)")
