"""A plain-PyTorch stand-in for the FlashQLA 0.1.3 functions the ``flashqla`` backend calls, so that the backend's
own work (spans cut from the prepared inputs, the gate cumsum and ``A`` handed from its solve to its backward,
packed boundaries, initial states and final-state gradients, the gate and L2-norm backward, the summaries beside)
runs on the CPU against the float64 reference.

It keeps FlashQLA's contract as its sources state it (``flash_qla/ops/gated_delta_rule/chunk/__init__.py``):
``forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, output_h, auto_cp, ...)`` ->
``(g_cumsum, A, o, h, final_state, cp_cache)`` on the raw natural-log gate ``g [1, T, HV]``;
``backward(q, k, v, g_cumsum, beta, A, do, dht, scale, initial_state, cu_seqlens, auto_cp, ...)`` ->
``(dq, dk, dv, dbeta, dg, dh0)``, ``dg`` float32 of the per-token gate and ``dh0`` None without initial states;
``chunk_local_cumsum(g, chunk_size, cu_seqlens)`` the cumulative gate within each chunk of each segment; dense
rows; states ``[N, HV, K, V]``. Its arithmetic is :mod:`kdacp.reference`'s in the inputs' dtype, so it checks the
plumbing, not FlashQLA's kernels; its backward recovers the gate from the cumsum it is given, so a raw gate handed
in its place shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kdacp import reference


def _bounds(cu_seqlens: torch.Tensor | None, tokens: int) -> list[int]:
    if cu_seqlens is None:
        return [0, tokens]
    assert cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1, cu_seqlens
    bounds = cu_seqlens.tolist()
    assert bounds[0] == 0 and bounds[-1] == tokens, (bounds, tokens)
    return bounds


def _check_dense(*tensors) -> None:
    for t in tensors:
        assert t is None or t.is_contiguous(), "FlashQLA's kernels read dense rows"


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
                       reverse: bool = False, zero_last_chunk: bool = False) -> torch.Tensor:
    assert g.dim() == 3 and g.stride(-1) == 1 and not reverse
    out = torch.empty_like(g)
    bounds = _bounds(cu_seqlens, g.shape[1])
    for a, b in zip(bounds[:-1], bounds[1:]):
        for s in range(a, b, chunk_size):
            e = min(s + chunk_size, b)
            out[:, s:e] = g[:, s:e].cumsum(1)
    return out


def _gate_of(cumsum: torch.Tensor, bounds: list[int], chunk_size: int) -> torch.Tensor:
    """The per-token gate whose chunk-local cumsum is ``cumsum``."""
    g = cumsum.clone()
    for a, b in zip(bounds[:-1], bounds[1:]):
        for s in range(a, b, chunk_size):
            e = min(s + chunk_size, b)
            g[:, s + 1:e] = cumsum[:, s + 1:e] - cumsum[:, s:e - 1]
    return g


@dataclass
class Solved:
    """What the stand-in's ``kkt_solve`` returns in place of ``A``: its inputs, so the backward can check it got
    the solve of the same keys and betas."""

    k: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: torch.Tensor | None
    chunk_size: int


def kkt_solve(k: torch.Tensor, b: torch.Tensor, chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None):
    _check_dense(k, b)
    return Solved(k, b, cu_seqlens, chunk_size)


def _run(q, k, v, g, beta, scale, initial_state, bounds):
    return reference.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                            output_final_state=True, cu_seqlens=torch.tensor(bounds))


def forward(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, output_final_state=True,
            output_h=False, auto_cp=True, state_v_first=False, enable_fwd_cp_cache=False, cp_context=None,
            is_train=None):
    assert q.shape[0] == 1 and g.shape == v.shape[:3] and not state_v_first and cp_context is None
    _check_dense(q, k, v, g, beta, initial_state)
    bounds = _bounds(cu_seqlens, q.shape[1])
    assert initial_state is None or initial_state.shape[0] == len(bounds) - 1
    o, final = _run(q, k, v, g, beta, scale, initial_state, bounds)
    return (chunk_local_cumsum(g, 64, cu_seqlens), kkt_solve(k, beta, 64, cu_seqlens), o, None,
            final if output_final_state else None, None)


def backward(q, k, v, g, beta, A, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
             state_v_first=False, auto_cp=True, cp_cache=None, cp_context=None):
    assert not state_v_first and cp_context is None and cp_cache is None
    _check_dense(q, k, v, g, beta, do, dht, initial_state)
    assert isinstance(A, Solved) and A.k is k and A.beta is beta and A.chunk_size == 64
    assert (A.cu_seqlens is None) == (cu_seqlens is None)
    assert cu_seqlens is None or torch.equal(A.cu_seqlens, cu_seqlens)
    bounds = _bounds(cu_seqlens, q.shape[1])
    raw = _gate_of(g, bounds, A.chunk_size)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, raw, beta)]
    h0 = None if initial_state is None else initial_state.detach().requires_grad_()
    with torch.enable_grad():  # called inside kdacp's autograd backward
        o, final = _run(*leaves, scale, h0, bounds)
        loss = (o * do).sum() + (0 if dht is None else (final * dht.to(final)).sum())
        grads = torch.autograd.grad(loss, leaves + ([h0] if h0 is not None else []))
    dq, dk, dv, dg, dbeta = grads[:5]
    # FlashQLA's dg is float32; float64 is kept for the float64 checks
    return dq, dk, dv, dbeta, dg if dg.dtype == torch.float64 else dg.float(), (grads[5] if h0 is not None else None)


def flashqla() -> SimpleNamespace:
    """The stand-in of :func:`kdacp.backends.flashqla_adapter.load_flashqla`'s namespace."""
    return SimpleNamespace(forward=forward, backward=backward, kkt_solve=kkt_solve, CHUNK_SIZE=64,
                           chunk_local_cumsum=chunk_local_cumsum)
