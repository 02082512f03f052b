"""Every memo kdacp keeps across calls, in one place, with its bound, and the one key type for memos keyed by
a tensor (:class:`TensorKey`); the memos themselves are ``functools.lru_cache``.

Each memo is built from host-side facts (shapes, boundaries, configurations) and saves host work or a
device sync on later calls; none holds a tensor a caller passed.

| memo | kept in | entries | bound |
|---|---|---|---|
| row indices of a rank's segments on the device | ``host_copies`` | ``(rows, device)`` | :data:`ROW_INDICES` (LRU) |
| host copies of boundaries passed on a GPU (``cu_seqlens=`` to the ops, the layers' per-batch contexts and a parallelised model) | ``host_copies`` | boundaries tensor | :data:`HOST_BOUNDARIES` (LRU) |
| boundaries of a span as a CPU tensor (for launchers that read them on the host) | ``host_copies`` | boundaries | :data:`HOST_TENSORS` (LRU) |
| piece tables of the chain kernel | ``affine`` | ``(pieces per sequence, device)`` | :data:`CHAIN_TABLES` (LRU) |
| sub-segment work lists of the summary kernels | ``kernels.subsegments`` | ``(bounds, chunk size, device)`` | :data:`SUMMARY_PLANS` (LRU) |
| pipeline stages that fit in shared memory | ``kernels.pipelining`` | ``(kernel, constants, dtypes, warps)`` | the kernels and configurations a process launches |
| FLA's packed-sequence arguments | ``backends.fla_backend`` | boundaries of a batch | :data:`FLA_VARLEN_BATCHES` (LRU) |
| attention-gym's int32 boundaries and summary rows | ``backends.attn_gym_backend`` | boundaries of a batch, rows of its spans | :data:`ATTN_GYM_BOUNDARIES` (LRU) |
| attention-gym's modules | ``backends.attn_gym_adapter`` | one | one |
| FLA's modules, and whether its GDN backward runs here | ``backends.fla_adapter`` | one | one |
| scan schedules | ``cp.exchanges.scan`` | ``(emits, affine)`` of a route | :data:`SCAN_SCHEDULES` (LRU) |
| rank layouts of a batch | ``cp.plan`` | ``(boundaries, batch size, rank lengths)`` | :data:`RANK_LAYOUTS` (LRU) |
| a plan's forward and backward routes | ``cp.schedule`` | ``(plan, tokens per row, state shape, dtype, device)`` | :data:`ROUTES` (LRU) |
| call signatures every rank verified | ``cp.checks`` | per live plan (:func:`~kdacp.cp.checks.verified_plans`) | freed with its plan |
| a layer context's per-batch contexts (:class:`~kdacp.cp.CPContext`: plan, boundaries, positions) | ``cp.context`` | ``(boundaries tensor, rows, tokens, device)`` per context | :data:`CP_CONTEXTS` (LRU) |
| Megatron THD boundaries checked against the zigzag layout | ``integrations.megatron`` | ``(boundaries tensor, tokens, cp)`` | ``CACHED_LAYOUTS`` there (LRU) |
| convolution halo routes | ``cp.batch_context`` | ``(layout, boundaries, rank, width, device)`` | :data:`HALO_ROUTES` (LRU) |
| boundaries of the convolution's input with its halos in line | ``kernels.short_conv.convolution`` | ``(local boundaries, range starts, width, rows, device)`` | :data:`HALO_BOUNDARIES` (LRU) |
| the opaque regions a compiled graph names by id (their settings: a layer context, the op, head dims; an attention module and its keywords) | ``compile`` | per distinct settings | one per mixer kind and context and one per attention module (each holds its module), for the process (:func:`~kdacp.compile.region_count`) |
"""
from __future__ import annotations

import weakref

import torch

ROW_INDICES = 256         # index lists (a rank's segments by role: a few per batch) kept on the device
SUMMARY_PLANS = 64        # summary kernels' sub-segment plans (a few per batch, forward and backward)
CHAIN_TABLES = 64         # the chain kernel's (first piece, count) tables (one or two per batch)
FLA_VARLEN_BATCHES = 16   # batches whose FLA cu_seqlens / chunk_indices are kept (a few in flight, per chunk size)
ATTN_GYM_BOUNDARIES = 32  # attention-gym's boundaries and summary rows kept (a few per batch: spans, forward and backward)
SCAN_SCHEDULES = 512      # routes whose scan schedule is kept
CP_CONTEXTS = 8           # per-batch contexts a layer context keeps (a few batches in flight, a few row shapes)
HALO_ROUTES = 64          # (batch, width) pairs whose convolution halo route is kept
HALO_BOUNDARIES = 64      # (batch, width) pairs whose in-line halo boundaries are kept
RANK_LAYOUTS = 64         # batches whose rank layouts are kept (every layer of a step asks for the same)
ROUTES = 64               # (plan, shape) pairs whose routes are kept
HOST_BOUNDARIES = 16      # device boundaries tensors whose host copy is kept (one per batch in flight; every layer passes the same)
HOST_TENSORS = 64         # spans' boundaries kept as CPU tensors (a few spans per batch: a rank's segments, pieces)


class TensorKey:
    """A memo key that stands for one tensor object as it is now: equal to another key of the same live
    object with the same version counter (an in-place change or a new tensor is another key; a freed
    tensor's key equals nothing, so a new tensor at a reused address misses). Holds only a weak reference:
    ``tensor`` returns the object, or None once it is freed."""

    __slots__ = ("_ref", "_id", "_version")

    def __init__(self, tensor: torch.Tensor):
        self._ref, self._id, self._version = weakref.ref(tensor), id(tensor), tensor._version

    @property
    def tensor(self) -> torch.Tensor | None:
        return self._ref()

    def __hash__(self) -> int:
        return hash((self._id, self._version))

    def __eq__(self, other) -> bool:
        return (isinstance(other, TensorKey) and self._id == other._id and self._version == other._version
                and self._ref() is not None and self._ref() is other._ref())
