"""Host-side facts (boundaries, row indices) on the device without a device sync, and row gathers and
scatters by host indices that need none; boundaries given on the device read to the host once per tensor.

A copy from pageable host memory to a GPU makes the host wait for everything queued before it
(PyTorch synchronises the stream), and so does indexing a CUDA tensor with a Python list (the list
becomes such a copy). The host then stops queueing work ahead of the GPU, which idles between
kernels. Here a host tensor is copied from pinned memory, asynchronously; row indices are slices
where they are consecutive, else index tensors made once per index list and device.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .caches import HOST_BOUNDARIES, HOST_TENSORS, ROW_INDICES, TensorKey

__all__ = ["to_device", "host_boundaries", "host_tensor", "take_rows", "row_taker", "put_rows"]


def host_boundaries(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """The values of ``cu_seqlens`` (a 1-D int tensor on any device) as Python ints, read once per tensor and
    kept while it lives unchanged (:class:`~kdacp.caches.TensorKey`): on a GPU the first read is a device sync,
    and the next call with the same tensor (every layer of a step passes the same boundaries) reads nothing, so
    the host stays ahead of the GPU, as FLA's own ops do with their per-tensor caches."""
    return _read_once(TensorKey(cu_seqlens))


@functools.lru_cache(maxsize=HOST_BOUNDARIES)
def _read_once(key: TensorKey) -> tuple[int, ...]:
    return tuple(int(c) for c in key.tensor.tolist())


@functools.lru_cache(maxsize=HOST_TENSORS)
def host_tensor(values: tuple[int, ...]) -> torch.Tensor:
    """``values`` as a 1-D int64 CPU tensor, one per distinct tuple while kept (:data:`~kdacp.caches.HOST_TENSORS`):
    shared, so callers must not modify it. Launchers that read boundaries on the host go through
    :func:`host_boundaries`, whose memo is keyed by tensor: the same tensor on every call is one entry there, where
    a new tensor a call took a new entry each time and pushed a batch's device boundaries out."""
    return torch.tensor(values, dtype=torch.int64)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``; on a GPU copied from pinned memory without a device sync (the
    caller must not change ``host`` afterwards). On the CPU, a copy: the device tensor is apart from the host one
    on every device (what the host-read checks of the tests tell apart).

    Raises:
        RuntimeError: on a GPU whose current stream is capturing a CUDA graph. PyTorch's pinned allocator queries
            CUDA events, which a capture forbids, and the failure would invalidate the capture; kdacp makes these
            tensors once per batch (its memos), so a call run once on the batch before the capture makes none.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device, copy=True)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("kdacp made a per-batch device tensor inside a CUDA-graph capture: run the captured "
                           "call once on the same batch before capturing it (torch.cuda.graph's warm-up)")
    return host.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=ROW_INDICES)
def _index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(rows, dtype=torch.int64), device)


def _as_slice(rows: tuple[int, ...]) -> slice | None:
    """``rows`` as a slice when they are consecutive and ascending, else None."""
    if rows and rows == tuple(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[-1] + 1)
    return None


def take_rows(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``t[rows]`` along dim 0 (``rows``: host integers, non-negative): a view for consecutive ascending rows,
    else a gather by an index tensor made once per ``(rows, device)``; no device sync either way."""
    if len(rows) == 1:  # a rank of many positions takes one row a message: the common call, kept short
        row = int(rows[0])
        return t[row:row + 1]
    rows = tuple(int(r) for r in rows)
    as_slice = _as_slice(rows)
    if as_slice is not None:
        return t[as_slice]
    return t.index_select(0, _index(rows, t.device))


def row_taker(t: torch.Tensor):
    """``rows -> take_rows(t, rows)`` for many takes from one ``t`` (a rank of many positions takes a message's row
    per position): one-row takes from views of every row made in one call (``t.split(1)``), a third of a
    :func:`take_rows` call's host time each, and a transposed ``t`` split once instead of each row transposed."""
    views = t.split(1)
    return lambda rows: views[rows[0]] if len(rows) == 1 else take_rows(t, rows)


def put_rows(t: torch.Tensor, rows: Sequence[int], values: torch.Tensor) -> None:
    """``t[rows] = values`` along dim 0, in place, as :func:`take_rows` (``rows`` distinct)."""
    rows = tuple(int(r) for r in rows)
    as_slice = _as_slice(rows)
    if as_slice is not None:
        t[as_slice] = values
    elif rows:
        t.index_copy_(0, _index(rows, t.device), values.to(t.dtype))
