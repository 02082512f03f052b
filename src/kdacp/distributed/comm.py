"""The raw ``torch.distributed`` calls of the context-parallel op (``chunk_kda``), in one place.

The layers' differentiable exchanges (halo, all-to-all) are in :mod:`kdacp.layers.comm`; group and
rank queries (``get_rank``, ``get_world_size``) are made where they are needed.

Ranks are ranks of the plan's group; point-to-point calls translate them to global ranks.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_device_mesh", "new_group", "group_timeout", "process_group", "post_recv", "send", "wait", "all_gather", "post_all_gather",
           "all_reduce_sum", "all_gather_signatures"]


def new_group(ranks=None, timeout=None):
    """A new process group over global ``ranks`` (default: all), on the default group's backend.

    ``timeout`` (a ``datetime.timedelta`` or seconds; default: the default group's timeout, as
    given to ``init_process_group``) bounds how long a rank waits for a message or collective of
    this group: when a peer fails mid-call, the other ranks raise after at most ``timeout``
    instead of hanging (gloo raises on the waiting rank; NCCL's watchdog aborts the group). Note
    that ``torch.distributed.new_group`` alone would use torch's global default (30 min gloo,
    10 min NCCL), not the default group's.

    On NCCL its communication streams get high priority: a state message posted right after the
    kernel that computes it then starts at once instead of queueing behind the next large compute
    kernel's blocks (``benchmarks/RESULTS.md``, "Op on two GPUs"). Collective: every rank of the default group calls
    it, in the same order.
    """
    timeout = _timeout(timeout)
    backend = dist.get_backend()
    return dist.new_group(ranks, timeout=timeout, backend=backend, pg_options=_options(backend, timeout))


def _timeout(timeout) -> timedelta | None:
    """``timeout`` as a ``timedelta`` (None: the default group's)."""
    if timeout is None:
        return group_timeout()
    if not isinstance(timeout, timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a datetime.timedelta or a positive number of seconds, got {timeout!r}")
        timeout = timedelta(seconds=float(timeout))
    return timeout


def _options(backend: str, timeout: timedelta | None):
    """The backend options of kdacp's groups: NCCL's high-priority streams (None on other backends)."""
    if backend != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    if timeout is not None:
        options._timeout = timeout  # else torch warns that the timeout argument overrides it
    return options


def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], *, mesh_dim_names: tuple[str, ...] | None = None,
                     timeout=None):
    """``torch.distributed.device_mesh.init_device_mesh`` whose every dimension's groups are made as
    :func:`new_group` makes them: high-priority NCCL streams (through ``init_device_mesh``'s
    ``backend_override``) and the timeout (default: the default group's). Call it after
    ``init_process_group``, on every rank. Meshes flattened from it (``mesh._flatten()``) get torch's default
    options unless given ``backend_override``."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    backend = dist.get_backend()
    options = _options(backend, _timeout(timeout))
    override = None if options is None else {dim: (backend, options) for dim in range(len(mesh_shape))}
    return torch_init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=mesh_dim_names,
                                  backend_override=override)


def process_group(group, what: str = "group"):
    """The process group of ``group``: a ``ProcessGroup`` as is, a 1-D ``DeviceMesh``'s group, None: the world.

    Raises:
        ValueError: a mesh of more than one dim (flatten it first: ``mesh._flatten()``).
    """
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):  # first: torch.compile cannot ask a ProcessGroup hasattr()
        return group
    if hasattr(group, "get_group") and hasattr(group, "ndim"):
        if group.ndim != 1:
            raise ValueError(f"{what} must be a process group or a 1-D DeviceMesh, got a {group.ndim}-D mesh "
                             "(flatten it: mesh._flatten())")
        return group.get_group()
    return group


def group_timeout(group=None) -> timedelta | None:
    """The timeout ``group`` (default: the default group) was created with, or None if torch does
    not expose it for its backend."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cuda", "cpu"):
        try:
            backend = pg._get_backend(torch.device(device))
        except (RuntimeError, ValueError, AttributeError):
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _note(error: Exception, what: str) -> None:
    """Say, in the traceback of a failed wait, what kdacp was waiting for and the likely cause."""
    if hasattr(error, "add_note"):
        error.add_note(f"kdacp: {what} did not complete; a peer rank probably failed (see the error raised "
                       "there) or the group's timeout passed (kdacp.new_cp_group(timeout=...))")


class _Work:
    """A ``dist.Work`` whose ``wait`` failure names the peer (everything else is the work's own)."""

    def __init__(self, work: dist.Work, what: str):
        self._work, self._what = work, what

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except RuntimeError as e:
            _note(e, self._what)
            raise

    def __getattr__(self, name):
        return getattr(self._work, name)


def post_recv(buffer: torch.Tensor, src: int, group) -> dist.Work:
    """Post a non-blocking receive into ``buffer`` from group rank ``src``."""
    return _Work(dist.irecv(buffer, src=_global_rank(group, src), group=group),
                 f"the receive from group rank {src}")


def send(tensor: torch.Tensor, dst: int, group) -> dist.Work:
    """Start a non-blocking send of ``tensor`` to group rank ``dst``; keep ``tensor`` alive until waited."""
    return _Work(dist.isend(tensor.contiguous(), dst=_global_rank(group, dst), group=group),
                 f"the send to group rank {dst}")


def wait(works) -> None:
    for work in works:
        work.wait()


def all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """``[world_size, *tensor.shape]``: every rank's ``tensor``."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(parts, tensor.contiguous(), group=group)
    except RuntimeError as e:
        _note(e, "an all-gather over the context-parallel group")
        raise
    return torch.stack(parts)


def post_all_gather(tensor: torch.Tensor, group):
    """Start a non-blocking all-gather of ``tensor``; returns ``(work, parts)``: after ``work.wait()``,
    ``torch.stack(parts)`` is ``[world_size, *tensor.shape]``. Keep ``tensor`` alive until then."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, tensor.contiguous(), group=group, async_op=True)
    return _Work(work, "an all-gather over the context-parallel group"), parts


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``tensor`` over the group (in place, returned)."""
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as e:
        _note(e, "an all-reduce over the context-parallel group")
        raise
    return tensor


def all_gather_signatures(signature: list[int], group, device: torch.device,
                          extra: torch.Tensor | None = None) -> list[list[int]]:
    """Every rank's small int64 ``signature``, gathered in one collective (on ``device``, which
    must suit the group's backend: CUDA for NCCL). ``extra``: int64 values already on ``device``
    appended to the row without a host sync (e.g. a non-finite flag computed there)."""
    local = torch.tensor(signature, dtype=torch.int64, device=device)
    if extra is not None:
        local = torch.cat([local, extra.to(device=device, dtype=torch.int64).reshape(-1)])
    return all_gather(local, group).tolist()
