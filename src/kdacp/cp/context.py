"""How a gated delta-rule token mixer (KDA, GDN) runs: on one device or context-parallel.

The mixer calls the same hooks either way (:class:`~kdacp.cp.hooks.CPHooks`); :data:`SINGLE_DEVICE`
implements them as identities and the recurrence op on one device, :class:`ContextParallel` with exchanges
(the op with the batch's plan).
Each batch's :class:`~kdacp.cp.CPContext` (plan, boundaries, halo routes) is built once, by the first
layer call that sees the batch, and kept (:data:`~kdacp.caches.CP_CONTEXTS`); nothing per call is stored, so
several calls may be in flight at once.

Token layout: the global batch (``B`` equal-length rows, or one packed row described by the global
``cu_seqlens``) is split along time by a token layout (:mod:`kdacp.cp.layout`): contiguous shards
(rank ``r`` holds shard ``r``), zigzag, per-document zigzag or any ranges; a rank's local tokens are its
ranges in global order. Under ``hybrid`` with Ulysses size ``U`` (contiguous only), ranks
``g*U ... g*U+U-1`` form Ulysses group ``g`` (their shards are contiguous); ranks with the same index in their
Ulysses group form a state group.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from ..caches import CP_CONTEXTS, TensorKey
from ..choices import MODES
from ..compile import hold_for_regions
from .groups import new_group as new_cp_group
from .layout import TokenLayout, check_layout
from .split import check_split
from .autograd_collectives import heads_to_time, time_to_heads
from .batch_context import CPContext, build_cp_context
from .hooks import CPHooks



class _SingleDevice(CPHooks):
    """The layer's hooks without context parallelism: every exchange is the identity."""

    backend = None  # the layer's own backend
    split = None  # the layer's own split inside the device
    layout = "contiguous"

    def __init__(self):
        self._contexts = lru_cache(maxsize=CP_CONTEXTS)(self._build_context)
        hold_for_regions(self)  # a setting of the token mixers' opaque regions under torch.compile

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

    def context(self, B: int, T: int, cu_seqlens: torch.Tensor | None, device=None) -> CPContext:
        """The :class:`~kdacp.cp.CPContext` of the batch of ``B`` rows of ``T`` local tokens (the state
        rank's, after :meth:`to_heads`), or of the packed row of global ``cu_seqlens``: built on the first call
        that passes this ``cu_seqlens`` tensor (or this shape of rows) and shared by every layer call after it.
        Keyed by the tensor object and its version counter (:class:`~kdacp.caches.TensorKey`), so an in-place
        change or a new tensor builds a new one. ``device``: of the rows' tensors (default the CPU)."""
        if cu_seqlens is not None:
            return self._contexts(TensorKey(cu_seqlens), 1, T, cu_seqlens.device)
        return self._contexts(None, B, T, torch.device("cpu" if device is None else device))

    def memo_sizes(self) -> dict:
        """Entries now in this context's memo: ``contexts`` (at most :data:`~kdacp.caches.CP_CONTEXTS`)."""
        return {"contexts": self._contexts.cache_info().currsize}

    def _build_context(self, key: TensorKey | None, B: int, T: int, device: torch.device) -> CPContext:
        return build_cp_context(None if key is None else key.tensor, local_length=T, batch_size=B, device=device)


SINGLE_DEVICE = _SingleDevice()


def _check_layout(layout, mode: str) -> None:
    check_layout(layout)
    if mode != "state" and not (layout == "contiguous" or isinstance(layout, TokenLayout) and layout.is_contiguous):
        raise ValueError(f"mode={mode!r} moves whole sequences of head shards in rank order: it needs "
                         f"layout='contiguous', got {layout!r} (only mode='state' follows another layout)")


def hybrid_ulysses_size(world_size: int) -> int | None:
    """The default Ulysses group size of ``hybrid`` mode: the smallest divisor of ``world_size`` strictly
    between 1 and it (None if there is none)."""
    return next((d for d in range(2, world_size) if world_size % d == 0), None)


class ContextParallel(_SingleDevice):
    """Context-parallel execution of KDA layers over a process group.

    Args:
        mode: ``"state"`` (time shards; convolution halo before each range, recurrence by
            ``kdacp.chunk_kda``), ``"ulysses"`` (all-to-all to head shards, local KDA
            on full sequences, all-to-all back; needs ``H % P == 0`` and ``HV % P == 0``) or
            ``"hybrid"`` (Ulysses inside groups of ``ulysses_size`` ranks, state across them).
        group: the context-parallel process group (default: the world); best one from
            :func:`kdacp.new_cp_group` (high-priority NCCL streams, its own queue). From a ``DeviceMesh``:
            :meth:`from_mesh`.
        ulysses_size: Ulysses group size for ``hybrid`` (``1 < ulysses_size < P``, divides ``P``; default
            :func:`hybrid_ulysses_size`, the smallest such divisor).
        strategy: state-exchange strategy for ``chunk_kda`` (one of ``kdacp.cp.STRATEGIES``:
            ``"p2p"``, ``"allgather"``, ``"scan"``, or ``"auto"``: the cost model's pick per plan).
        backend: KDA backend (``"auto"``, ``"torch"``, ``"fla"``); None uses the layer's.
        split: the recurrence's split inside the device on every layer (as :func:`kdacp.chunk_kda`'s ``split``:
            ``"auto"``, an int, or None), or None for each layer's own (default; the layers' own default is
            ``"auto"``).
        layout: how the global batch is split over the ranks: ``"contiguous"``, ``"zigzag"`` (rank ``r``
            holds chunks ``r`` and ``2P-1-r`` of ``2P``), ``"document_zigzag"`` (the same per document of a
            packed row), ``"balanced_documents"`` (a packed row's long documents so, its short ones whole:
            :func:`~kdacp.cp.layout.balanced_document_layout`), a :class:`~kdacp.cp.layout.TokenLayout` (any ranges)
            or a layout rule (a callable ``(cu_seqlens, P, device) -> TokenLayout``, called once per batch:
            :func:`~kdacp.cp.layout.is_layout_rule`). Every layer call and softmax attention follow it; only
            ``"state"`` mode takes another than contiguous.

    Raises:
        ValueError: unknown mode, a Ulysses size that does not fit the group, or an unknown layout (or one
            that is not contiguous outside ``"state"`` mode).

    Building one is collective over the world when ``mode="hybrid"`` (it creates subgroups).
    """

    def __init__(self, mode: str, group=None, *, ulysses_size: int | None = None, strategy: str = "p2p",
                 backend: str | None = None, layout: str | TokenLayout = "contiguous", split=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        _check_layout(layout, mode)
        check_split(split)
        group = dist.group.WORLD if group is None else group
        ranks = dist.get_process_group_ranks(group)
        P = len(ranks)
        if mode == "hybrid":
            if ulysses_size is None:
                ulysses_size = hybrid_ulysses_size(P)
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
        self._setup(mode, group, U, ulysses_group, state_group, strategy, backend, layout, split)

    @classmethod
    def from_mesh(cls, mesh, *, strategy: str = "p2p", backend: str | None = None,
                  layout: str | TokenLayout = "contiguous", split=None) -> ContextParallel:
        """The context over a ``DeviceMesh`` (best one from :func:`kdacp.init_device_mesh`: high-priority NCCL
        streams): a 1-D mesh runs ``"state"`` mode over its group; a 2-D one ``(state, ulysses)`` runs Ulysses
        inside each group of its last dim (consecutive ranks) and the state exchange across them (``"hybrid"``;
        ``"ulysses"`` or ``"state"`` where a dim has size 1), the two flattened into the whole group
        (``mesh._flatten()``). ``strategy``, ``backend``, ``layout``, ``split``: as the constructor's.

        Raises:
            ValueError: a mesh of another dimensionality, a 2-D one without ``mesh_dim_names``, or one whose
                flattened ranks are not in ``(state, ulysses)`` order.
        """
        if mesh.ndim == 1:
            return cls("state", mesh.get_group(), strategy=strategy, backend=backend, layout=layout, split=split)
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
        _check_layout(layout, mode)
        check_split(split)
        self = cls.__new__(cls)
        self._setup(mode, group, U, mesh.get_group(1), mesh.get_group(0), strategy, backend, layout, split)
        return self

    def _setup(self, mode: str, group, U: int, ulysses_group, state_group, strategy: str, backend, layout,
               split) -> None:
        """Hold the groups: ``group`` of ``P`` ranks, Ulysses groups of ``U`` consecutive ranks of it, state
        groups of the ranks with one index in their Ulysses group."""
        _SingleDevice.__init__(self)
        self.mode, self.strategy, self.backend, self.layout, self.split = mode, strategy, backend, layout, split
        self.group = group
        P, rank = dist.get_world_size(group), dist.get_rank(group)
        self.ulysses_size, self.state_size = U, P // U
        self.ulysses_rank, self.state_rank = rank % U, rank // U
        self.ulysses_group = group if U == P else ulysses_group if U > 1 else None
        self.state_group = group if U == 1 else state_group if U < P else None

    def __repr__(self) -> str:
        layout = self.layout if not isinstance(self.layout, TokenLayout) else "TokenLayout(...)"
        return (f"ContextParallel(mode={self.mode!r}, ulysses_size={self.ulysses_size}, "
                f"state_size={self.state_size}, strategy={self.strategy!r}, layout={layout!r}"
                + ("" if self.split is None else f", split={self.split!r}") + ")")

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

    def attention_context(self, B: int, T: int, cu_seqlens: torch.Tensor | None, device=None) -> CPContext:
        """The batch's :class:`~kdacp.cp.CPContext` over the whole group (``T``: this rank's tokens before
        :meth:`to_heads`), for softmax attention: the layers' own under ``"state"`` mode, else one without a
        plan (built once per batch, like :meth:`context`)."""
        if self.ulysses_size == 1:
            return self.context(B, T, cu_seqlens, device)
        if cu_seqlens is not None:
            return self._contexts(TensorKey(cu_seqlens), 1, T, cu_seqlens.device, whole_group=True)
        return self._contexts(None, B, T, torch.device("cpu" if device is None else device), whole_group=True)

    def _build_context(self, key: TensorKey | None, B: int, T: int, device: torch.device,
                       whole_group: bool = False) -> CPContext:
        cu = None if key is None else key.tensor
        if whole_group:
            return build_cp_context(cu, local_length=T, batch_size=B, layout=self.layout, group=self.group,
                                    with_plan=False, device=device)
        group = self.state_group if self.state_size > 1 else None
        return build_cp_context(cu, local_length=T, batch_size=B, layout=self.layout, group=group,
                                strategy=self.strategy, device=device)
