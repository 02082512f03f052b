"""A plain-PyTorch stand-in for attention-gym 0.0.17's staged cores and FLA's gate and L2-norm kernels, so that the
``attn_gym`` backend's own work (spans cut from a prepared handle, summary rows, V-major states, the gradient pass
over a prefix from the reverse maps, a backward handle rebuilt after its ``run``, the gate and L2-norm backward)
runs on the CPU against the float64 reference.

Where attention-gym rounds to float32 (states, maps, the gate) it keeps the inputs' dtype, so that float64 runs
compare tightly. It keeps attention-gym's documented contract (``kda/stages.py``, ``gdn/stages.py``,
``context_parallel.py``):
handles with ``saved`` (its NamedTuple fields), token-first ``factors`` and ``metadata``; int32 ``cu_seqlens``;
states ``[N, HV, V, K]``; maps ``[R, HV, V + K, K]`` packed ``[B; A]`` (``H_out = H_in A + B``) and reverse
``[C; R]`` (``dH_in = dH_out R + C``), for rows that are whole segments only; a backward handle whose ``run``
releases it. Its arithmetic is :mod:`kdacp.reference`'s, so it checks the plumbing, not attention-gym's kernels.
It reads its inputs from ``saved`` and ``factors`` both, so that a wrong cut of either shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch

from kdacp import reference


class ChunkKDASaved(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cumulative_gate: torch.Tensor  # here the gate itself: the backend only cuts it
    beta: torch.Tensor
    aqk: torch.Tensor | None
    akk: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    chunk_offsets: torch.Tensor | None


class ChunkGDNSaved(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cumulative_gate: torch.Tensor
    beta: torch.Tensor
    inverse: torch.Tensor
    cu_seqlens: torch.Tensor | None
    chunk_offsets: torch.Tensor | None


class Factors(NamedTuple):
    kg: torch.Tensor  # here k itself
    u: torch.Tensor   # here v itself


class Metadata(NamedTuple):
    cu_seqlens: torch.Tensor
    chunk_offsets: torch.Tensor
    capacity: int
    chunk_size: int


def prepare_ragged_chunk_metadata(cu_seqlens: torch.Tensor, tokens: int, chunk_size: int) -> Metadata:
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous() and int(cu_seqlens[-1]) == tokens
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1) // chunk_size
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    return Metadata(cu_seqlens, offsets, int(offsets[-1]), chunk_size)


def _cu(saved, tokens: int) -> list[int]:
    return [0, tokens] if saved.cu_seqlens is None else saved.cu_seqlens.tolist()


def _kv(state):
    return None if state is None else state.transpose(-1, -2)


def _core(saved, factors, gate=None):
    """``(q, k, v, g [.., HV, K], beta)`` in float64, ``k, v`` from the factors where given."""
    k = saved.k if factors is None else factors.kg
    v = saved.v if factors is None else factors.u
    g = saved.cumulative_gate if gate is None else gate
    if g.dim() == 3:  # GDN: one gate per head
        g, _ = reference.scalar_gate_as_kda(g, saved.q.shape[-1])
    return saved.q.double(), k.double(), v.double(), g.double(), saved.beta.double()


def _run(q, k, v, g, beta, cu, scale, h0_vk):
    """``(o, final [n, HV, K, V])`` of the reference from V-major initial states."""
    return reference.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=_kv(h0_vk), output_final_state=True,
                               cu_seqlens=torch.tensor(cu))


def _segment(saved, factors, a: int, b: int, cu: list[int]):
    """The inputs of tokens ``[a, b)``, which must be one segment of ``cu`` (attention-gym's rows contract)."""
    assert any(cu[i] == a and cu[i + 1] == b for i in range(len(cu) - 1)), (a, b, cu)
    return [t[:, a:b] for t in _core(saved, factors)]


@dataclass
class Prepared:
    saved: NamedTuple
    factors: Factors
    metadata: Metadata | None
    scale: float

    def state_summaries(self, bounds: torch.Tensor) -> torch.Tensor:
        assert bounds.dtype == torch.int32 and bounds.shape[1] == 2
        cu, maps = _cu(self.saved, self.saved.q.shape[1]), []
        for a, b in bounds.tolist():
            x = _segment(self.saved, self.factors, a, b, cu)
            HV, K = x[2].shape[2], x[0].shape[-1]
            zero = x[0].new_zeros(1, HV, K, K)
            S_ext = _run(*x, [0, b - a], self.scale, zero)[1]
            A = _run(*x, [0, b - a], self.scale, torch.eye(K, dtype=x[0].dtype).expand(1, HV, K, K))[1] - S_ext
            maps.append(torch.cat([S_ext.transpose(-1, -2), A.transpose(-1, -2)], -2))
        return torch.cat(maps)

    def run(self, initial_state=None, *, output_final_state=False):
        q = self.saved.q
        o, final = _run(*_core(self.saved, self.factors), _cu(self.saved, q.shape[1]), self.scale, initial_state)
        return o.to(q.dtype), (final.transpose(-1, -2) if output_final_state else None)


@dataclass
class Backward:
    saved: NamedTuple
    d_output: torch.Tensor
    initial_state: torch.Tensor | None
    scale: float
    released: bool = False

    def _grads(self, x, cu, d_out, dht_vk, h0_vk):
        leaves = [t.detach().requires_grad_() for t in x]
        h0 = None if h0_vk is None else h0_vk.double().detach().requires_grad_()
        with torch.enable_grad():  # called inside kdacp's autograd backward
            o, final = _run(*leaves, cu, self.scale, h0)
            loss = (o * d_out.double()).sum()
            if dht_vk is not None:
                loss = loss + (final * dht_vk.double().transpose(-1, -2)).sum()
            grads = torch.autograd.grad(loss, leaves + ([h0] if h0 is not None else []))
        return grads[:5], (grads[5] if h0 is not None else None)

    def state_grad_summaries(self, bounds: torch.Tensor) -> torch.Tensor:
        assert not self.released, "state_grad_summaries after run: attention-gym released its tensors"
        cu, maps = _cu(self.saved, self.saved.q.shape[1]), []
        for a, b in bounds.tolist():
            x = _segment(self.saved, None, a, b, cu)
            HV, K = x[2].shape[2], x[0].shape[-1]
            zero = x[0].new_zeros(1, HV, K, K)
            _, C = self._grads(x, [0, b - a], self.d_output[:, a:b], None, zero)
            S_ext = _run(*x, [0, b - a], self.scale, zero)[1]
            M = _run(*x, [0, b - a], self.scale, torch.eye(K, dtype=x[0].dtype).expand(1, HV, K, K))[1] - S_ext
            maps.append(torch.cat([C, M], -2))  # C is V-major already: the gradient of the V-major state
        return torch.cat(maps)

    def run(self, d_final_state=None):
        assert not self.released, "run twice: attention-gym released its tensors"
        self.released = True
        q = self.saved.q
        (dq, dk, dv, dg, dbeta), dh0 = self._grads(list(_core(self.saved, None)), _cu(self.saved, q.shape[1]),
                                                    self.d_output, d_final_state, self.initial_state)
        if self.saved.cumulative_gate.dim() == 3:
            dg = dg.sum(-1)
        return dq, dk, dv, dg, dbeta, dh0


def _prepare(saved_type, q, k, v, gate, beta, *, cu_seqlens=None, scale=None):
    assert q.shape[0] == 1 and q.dtype == k.dtype == v.dtype
    assert cu_seqlens is None or (cu_seqlens.dtype == torch.int32 and cu_seqlens.device == q.device)
    metadata = None if cu_seqlens is None else prepare_ragged_chunk_metadata(cu_seqlens, q.shape[1], 64)
    offsets = None if metadata is None else metadata.chunk_offsets
    extra = (q, q) if saved_type is ChunkKDASaved else (beta,)
    saved = saved_type(q, k, v, gate, beta, *extra, cu_seqlens, offsets)
    return Prepared(saved, Factors(k, v), metadata, scale)


def _prepare_backward(saved, d_output, initial_state, *, scale):
    return Backward(saved, d_output, None if initial_state is None else initial_state.contiguous(), scale)


def attn_gym() -> SimpleNamespace:
    """The stand-in of :func:`kdacp.backends.attn_gym_adapter.load_attn_gym`'s namespace."""
    return SimpleNamespace(
        chunk_kda_prepare=lambda *a, **kw: _prepare(ChunkKDASaved, *a, **kw),
        chunk_gdn_prepare=lambda *a, **kw: _prepare(ChunkGDNSaved, *a, **kw),
        chunk_kda_prepare_backward=_prepare_backward, chunk_gdn_prepare_backward=_prepare_backward,
        ChunkKDASaved=ChunkKDASaved, ChunkGDNSaved=ChunkGDNSaved,
        prepare_ragged_chunk_metadata=prepare_ragged_chunk_metadata, MAX_GATE_LOWER_BOUND_MAGNITUDE=5.9139)


def _vjp(fn, inputs: list, dy):
    """The gradients of ``(fn(*inputs) * dy).sum()`` w.r.t. the tensors of ``inputs`` (None where None)."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    with torch.enable_grad():
        y = fn(*leaves)
        wrt = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad((y * dy.double()).sum(), wrt))
    return [None if t is None else next(grads).to(s.dtype) for t, s in zip(leaves, inputs)]


def fla() -> SimpleNamespace:
    """The stand-in of FLA's pieces the backend calls besides attention-gym: L2 norm and the in-kernel gates."""
    def l2norm_fwd(x):
        rstd = torch.rsqrt((x.double() ** 2).sum(-1) + 1e-6)
        return (x.double() * rstd[..., None]).to(x.dtype), rstd.to(x.dtype)

    def l2norm_bwd(y, rstd, dy):
        y, dy, r = y.double(), dy.double(), rstd.double()[..., None]
        return (dy * r - (dy * y).sum(-1, keepdim=True) * y * r).to(dy.dtype)

    def gdn_gate(g, A_log, dt_bias):
        return reference.gdn_gate(g, A_log, dt_bias)

    def kda_gate_bwd(g, A_log, dt_bias, dyg, lower_bound):
        return _vjp(lambda g, a, b: reference.kda_gate(g, a, b, lower_bound), [g, A_log, dt_bias], dyg)

    def gdn_gate_bwd(g, A_log, dt_bias, dyg):
        return _vjp(gdn_gate, [g, A_log, dt_bias], dyg)

    return SimpleNamespace(
        l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd,
        kda_gate_fwd=lambda g, A_log, dt_bias, lower_bound=None: reference.kda_gate(g, A_log, dt_bias, lower_bound),
        kda_gate_bwd=kda_gate_bwd, gdn_gate_fwd=gdn_gate,
        gdn_gate_bwd=gdn_gate_bwd)
