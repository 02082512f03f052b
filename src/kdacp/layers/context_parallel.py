"""How a gated delta-rule token mixer (KDA, GDN) runs: on one device or context-parallel.

The mixer calls the same hooks either way (``to_heads``, ``head_shard``, ``conv_context``,
``recurrence``, ``to_sequence``, and ``validate_heads`` when attached); :data:`SINGLE_DEVICE`
implements them as identities and the recurrence op on one device, :class:`ContextParallel` with
exchanges (the op with the batch's plan).
Nothing per call is stored on these objects (only what each packed batch's ``cu_seqlens`` implies,
built once per batch), so several calls may be in flight at once.

Token layout: the global batch (``B`` equal-length sequences, or one packed batch described by the
global ``cu_seqlens``) is split along time into equal shards, shard ``r`` on rank ``r`` of ``group``.
Under ``hybrid`` with Ulysses size ``U``, ranks ``g*U ... g*U+U-1`` form Ulysses group ``g`` (their
shards are contiguous); ranks with the same index in their Ulysses group form a state group.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..caches import CACHED_BATCHES, CACHED_SHAPES
from ..distributed import build_cp_plan, new_cp_group
from ..distributed.plan import local_cu_seqlens
from .comm import heads_to_time, shift_right, time_to_heads

__all__ = ["ConvContext", "ContextParallel", "SINGLE_DEVICE", "MODES"]

MODES = ("state", "ulysses", "hybrid")


@dataclass(frozen=True)
class ConvContext:
    """Where the short convolution's local tokens sit in the global batch.

    ``state_group``: the group whose previous rank supplies the left halo (None: no halo needed);
    ``cu_seqlens`` / ``cu_seqlens_cpu``: ``[n+1]`` int64 boundaries of the local sequences on the device
    and on the host (None without packed sequences; the host copy may be None on one device);
    ``halo_tokens``: how many of the tokens just before this rank belong to the first local sequence
    (0: it starts here; the halo's earlier tokens, of other sequences, are masked to zero).
    """

    state_group: object
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None = None
    halo_tokens: int = 0

    def left_halos(self, xs: list[torch.Tensor], width: int) -> list[torch.Tensor | None]:
        """The ``width`` tokens before each ``x [B, T, C_i]`` on the previous state rank, fetched in
        one exchange (zeros where no sequence crosses into this rank); Nones when there is no previous rank."""
        if self.state_group is None or width == 0:
            return [None] * len(xs)
        if xs[0].shape[1] < width:
            raise ValueError(f"each rank needs at least conv_size-1={width} tokens for the convolution halo, "
                             f"got {xs[0].shape[1]}")
        tails = torch.cat([x[:, -width:] for x in xs], dim=-1)
        halos = shift_right(tails, self.state_group)
        if self.halo_tokens < width:
            # Masked, not dropped: the previous rank waits for the halo's gradient in its backward.
            # masked_fill rather than a product, so that a NaN of another sequence stays there.
            other = torch.arange(width, device=halos.device) < width - self.halo_tokens
            halos = halos.masked_fill(other[None, :, None], 0)
        return list(halos.split([x.shape[-1] for x in xs], dim=-1))


@dataclass(frozen=True)
class _Batch:
    """What a rank knows of one packed batch, built once per ``cu_seqlens`` tensor: its host copy
    ``cu_cpu``, the plan of its recurrence (None without state exchange) and its convolution context."""

    cu_cpu: torch.Tensor
    plan: object
    conv: ConvContext


class _SingleDevice:
    """The layer's hooks without context parallelism: every exchange is the identity."""

    backend = None  # the layer's own backend

    def __init__(self):
        self._batches: dict = {}

    def validate_heads(self, num_heads: int, num_v_heads: int) -> None:
        pass

    def head_shard(self) -> tuple[int, int]:
        """``(index, count)`` of this rank's head shard."""
        return 0, 1

    def head_slice(self, num_heads: int) -> slice:
        """This rank's share of ``num_heads`` heads (all of them outside Ulysses); ``num_heads`` must
        split evenly over the head shards."""
        u, U = self.head_shard()
        return slice(u * num_heads // U, (u + 1) * num_heads // U)

    def to_heads(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return xs

    def to_sequence(self, o: torch.Tensor, final_state: torch.Tensor | None):
        return o, final_state

    def conv_context(self, T: int, cu_seqlens: torch.Tensor | None) -> ConvContext:
        # the batch's host copy, made once per batch: the convolution kernels then check it without a sync
        return ConvContext(None, cu_seqlens, None if cu_seqlens is None else self._batch(cu_seqlens, T).cu_cpu)

    def recurrence(self, op, q, k, v, g, beta, *, cu_seqlens, backend, **kwargs):
        """``op`` (:func:`kdacp.chunk_kda` or :func:`kdacp.chunk_gated_delta_rule`, with its own arguments)
        on this rank's tokens: ``cu_seqlens`` the batch's global ``[N+1]`` boundaries or None; under
        context parallelism with the batch's plan (``cp=``), built once per batch."""
        cu_cpu = None if cu_seqlens is None else self._batch(cu_seqlens, q.shape[1]).cu_cpu
        return op(q, k, v, g, beta, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_cpu, backend=backend, **kwargs)

    def _build_batch(self, cu: tuple[int, ...], device: torch.device, T: int) -> _Batch:
        return _Batch(torch.tensor(cu, dtype=torch.int64), None, ConvContext(None, None))

    def _batch(self, cu_seqlens: torch.Tensor, T: int) -> _Batch:
        """The :class:`_Batch` of ``cu_seqlens`` (global ``[N+1]``) for ``T`` local tokens, built on the
        first call that passes this tensor and shared by every layer call after it: one host copy (a
        device sync for a CUDA tensor) and one plan per batch, not per layer. Keyed by the tensor
        object itself and its version counter, so an in-place change or a new tensor builds a new one."""
        key = (id(cu_seqlens), cu_seqlens._version, T)
        hit = self._batches.get(key)
        if hit is not None and hit[0]() is cu_seqlens:
            return hit[1]
        batch = self._build_batch(tuple(int(c) for c in cu_seqlens.tolist()), cu_seqlens.device, T)
        if len(self._batches) >= CACHED_BATCHES:  # drop the oldest
            self._batches.pop(next(iter(self._batches)))
        self._batches[key] = (weakref.ref(cu_seqlens), batch)
        return batch


SINGLE_DEVICE = _SingleDevice()


class ContextParallel(_SingleDevice):
    """Context-parallel execution of KDA layers over a process group.

    Args:
        mode: ``"state"`` (time shards; convolution halo from the previous rank, recurrence by
            ``kdacp.chunk_kda``), ``"ulysses"`` (all-to-all to head shards, local KDA
            on full sequences, all-to-all back; needs ``H % P == 0`` and ``HV % P == 0``) or
            ``"hybrid"`` (Ulysses inside groups of ``ulysses_size`` ranks, state across them).
        group: the context-parallel process group (default: the world); best one from
            :func:`kdacp.new_cp_group` (high-priority NCCL streams, its own queue). From a ``DeviceMesh``:
            :meth:`from_mesh`.
        ulysses_size: Ulysses group size for ``hybrid`` (``1 < ulysses_size < P``, divides ``P``).
        strategy: state-exchange strategy for ``chunk_kda`` (one of ``kdacp.distributed.STRATEGIES``:
            ``"p2p"``, ``"allgather"``, ``"scan"``, or ``"auto"``: the cost model's pick per plan).
        backend: KDA backend (``"auto"``, ``"torch"``, ``"fla"``); None uses the layer's.

    Raises:
        ValueError: unknown mode, or a Ulysses size that does not fit the group.

    Building one is collective over the world when ``mode="hybrid"`` (it creates subgroups).
    """

    def __init__(self, mode: str, group=None, *, ulysses_size: int | None = None, strategy: str = "p2p",
                 backend: str | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        group = dist.group.WORLD if group is None else group
        ranks = dist.get_process_group_ranks(group)
        P = len(ranks)
        if mode == "hybrid":
            if ulysses_size is None or not 1 < ulysses_size < P or P % ulysses_size:
                raise ValueError(f"hybrid mode needs 1 < ulysses_size < P with P % ulysses_size == 0; "
                                 f"got ulysses_size={ulysses_size}, P={P}")
        elif ulysses_size is not None and ulysses_size != (P if mode == "ulysses" else 1):
            raise ValueError(f"ulysses_size is only set for mode='hybrid' (mode={mode!r}, got {ulysses_size})")
        U = {"state": 1, "ulysses": P, "hybrid": ulysses_size}[mode]
        rank = ranks.index(dist.get_rank())
        ulysses_group = group if U == P else None
        state_group = group if U == 1 else None
        if mode == "hybrid":
            # Collective over the world: every rank creates every subgroup, in one order.
            for g in range(P // U):
                sub = new_cp_group(ranks[g * U:(g + 1) * U])
                if g == rank // U:
                    ulysses_group = sub
            for u in range(U):
                sub = new_cp_group(ranks[u::U])
                if u == rank % U:
                    state_group = sub
        self._setup(mode, group, U, ulysses_group, state_group, strategy, backend)

    @classmethod
    def from_mesh(cls, mesh, *, strategy: str = "p2p", backend: str | None = None) -> ContextParallel:
        """The context over a ``DeviceMesh`` (best one from :func:`kdacp.init_device_mesh`: high-priority NCCL
        streams): a 1-D mesh runs ``"state"`` mode over its group; a 2-D one ``(state, ulysses)`` runs Ulysses
        inside each group of its last dim (consecutive ranks) and the state exchange across them (``"hybrid"``;
        ``"ulysses"`` or ``"state"`` where a dim has size 1), the two flattened into the whole group
        (``mesh._flatten()``). ``strategy``, ``backend``: as the constructor's.

        Raises:
            ValueError: a mesh of another dimensionality, a 2-D one without ``mesh_dim_names``, or one whose
                flattened ranks are not in ``(state, ulysses)`` order.
        """
        if mesh.ndim == 1:
            return cls("state", mesh.get_group(), strategy=strategy, backend=backend)
        if mesh.ndim != 2:
            raise ValueError(f"a context-parallel mesh has 1 dim (state) or 2 (state, ulysses), got {mesh.ndim}")
        if not mesh.mesh_dim_names:
            raise ValueError("a 2-D context-parallel mesh needs mesh_dim_names (e.g. ('state', 'ulysses')) to be "
                             "flattened into the whole group")
        S, U = mesh.shape
        group = mesh._flatten().get_group()
        if dist.get_rank(group) != mesh.get_local_rank(0) * U + mesh.get_local_rank(1):
            raise ValueError("the flattened mesh's ranks are not in (state, ulysses) order")
        mode = "ulysses" if S == 1 else "state" if U == 1 else "hybrid"
        self = cls.__new__(cls)
        self._setup(mode, group, U, mesh.get_group(1), mesh.get_group(0), strategy, backend)
        return self

    def _setup(self, mode: str, group, U: int, ulysses_group, state_group, strategy: str, backend) -> None:
        """Hold the groups: ``group`` of ``P`` ranks, Ulysses groups of ``U`` consecutive ranks of it, state
        groups of the ranks with one index in their Ulysses group."""
        _SingleDevice.__init__(self)
        self.mode, self.strategy, self.backend = mode, strategy, backend
        self._row_plans: dict = {}
        self.group = group
        P, rank = dist.get_world_size(group), dist.get_rank(group)
        self.ulysses_size, self.state_size = U, P // U
        self.ulysses_rank, self.state_rank = rank % U, rank // U
        self.ulysses_group = group if U == P else ulysses_group if U > 1 else None
        self.state_group = group if U == 1 else state_group if U < P else None

    def __repr__(self) -> str:
        return (f"ContextParallel(mode={self.mode!r}, ulysses_size={self.ulysses_size}, "
                f"state_size={self.state_size}, strategy={self.strategy!r})")

    def validate_heads(self, num_heads: int, num_v_heads: int) -> None:
        """Raise ``ValueError`` unless both head counts split evenly over the Ulysses group."""
        U = self.ulysses_size
        if num_heads % U or num_v_heads % U:
            raise ValueError(f"mode={self.mode!r} shards heads over {U} ranks: needs num_heads % {U} == 0 and "
                             f"num_v_heads % {U} == 0, got num_heads={num_heads}, num_v_heads={num_v_heads}")

    def head_shard(self) -> tuple[int, int]:
        return self.ulysses_rank, self.ulysses_size

    def to_heads(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sequence shards ``[B, T, C_i]`` -> head shards ``[B, U*T, C_i/U]``, in one all-to-all.

        Each ``C_i`` is head-major, so channel block ``u`` holds head shard ``u``.
        """
        U = self.ulysses_size
        if U == 1:
            return xs
        parts = time_to_heads([x.unflatten(-1, (U, -1)) for x in xs], self.ulysses_group)
        return [part.flatten(-2) for part in parts]

    def to_sequence(self, o: torch.Tensor, final_state: torch.Tensor | None):
        """Head shard ``o [B, U*T, HV/U, V]`` -> sequence shard ``[B, T, HV, V]``, and the head-sharded
        ``final_state [N, HV/U, K, V]`` -> ``[N, HV, K, V]`` on every rank."""
        if self.ulysses_size == 1:
            return o, final_state
        return heads_to_time(o, self.ulysses_group, final_state)

    def conv_context(self, T: int, cu_seqlens: torch.Tensor | None) -> ConvContext:
        """``T``: tokens of this state rank (after ``to_heads``); they start at ``state_rank * T``."""
        if cu_seqlens is not None:
            return self._batch(cu_seqlens, T).conv
        group = self.state_group if self.state_size > 1 else None
        return ConvContext(group, None, halo_tokens=self.state_rank * T)

    def recurrence(self, op, q, k, v, g, beta, *, cu_seqlens, backend, **kwargs):
        backend = self.backend or backend
        if self.state_size == 1:
            return super().recurrence(op, q, k, v, g, beta, cu_seqlens=cu_seqlens, backend=backend, **kwargs)
        B, T = q.shape[:2]
        plan = self._row_plan(B, T) if cu_seqlens is None else self._batch(cu_seqlens, T).plan
        return op(q, k, v, g, beta, backend=backend, cp=plan, **kwargs)

    def _build_batch(self, cu: tuple[int, ...], device: torch.device, T: int) -> _Batch:
        plan = None
        if self.state_size > 1:
            plan = build_cp_plan(cu, local_lengths=[T] * self.state_size, group=self.state_group,
                                 strategy=self.strategy)
        start, end = self.state_rank * T, (self.state_rank + 1) * T
        local = torch.tensor(local_cu_seqlens(cu, start, end), dtype=torch.int64)
        # from pinned memory: a copy from pageable memory would make the host wait for the queue
        local_device = (local.pin_memory() if device.type == "cuda" else local).to(device, non_blocking=True)
        group = self.state_group if self.state_size > 1 else None
        first_start = max(c for c in cu if c <= start)
        return _Batch(torch.tensor(cu, dtype=torch.int64), plan,
                      ConvContext(group, local_device, local, halo_tokens=start - first_start))

    def memo_sizes(self) -> dict:
        """Entries now in this context's memos: ``batches`` (at most :data:`CACHED_BATCHES`) and ``row_plans``
        (at most :data:`CACHED_SHAPES`)."""
        return {"batches": len(self._batches), "row_plans": len(self._row_plans)}

    def _row_plan(self, B: int, T: int):
        """The plan of ``B`` rows of ``T`` tokens per rank, built once per shape (the last
        :data:`CACHED_SHAPES` shapes are kept), so that the op checks the ranks' agreement once
        per shape rather than on every layer call."""
        key = (B, T)
        plan = self._row_plans.pop(key, None)
        if plan is None:
            plan = build_cp_plan(local_lengths=[T] * self.state_size, batch_size=B, group=self.state_group,
                                 strategy=self.strategy)
            if len(self._row_plans) >= CACHED_SHAPES:  # every rank sees the same shapes: same evictions
                self._row_plans.pop(next(iter(self._row_plans)))
        self._row_plans[key] = plan  # most recent last
        return plan
