"""kdacp's process groups: making them (high-priority NCCL streams, a bounded wait) and reading them.

The messages and collectives over them are in :mod:`.collectives`.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


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
