"""Context parallelism for chunk KDA over ``torch.distributed``.

Build a :class:`CPPlan` once per batch with :func:`build_cp_plan`, then call :func:`kdacp.chunk_kda`
with ``cp=plan`` on every rank with that rank's tokens. Give both a group from :func:`new_cp_group`
(created once, at start-up): its NCCL streams have high priority, which keeps the state exchange off
the compute kernels' queue, and it keeps kdacp's messages out of the queue of other collectives
(gradient all-reduces) on the default group.

:class:`RankRole` runs one rank's part of a call in this process, against the plan's exchange or a
:class:`StandInExchange` that moves nothing: how benchmarks time each rank's role and tests check its schedule.
"""
from .groups import init_device_mesh
from .groups import new_group as new_cp_group
from .plan import STRATEGIES, CPPlan, build_cp_plan
from .rank_role import RankRole, StandInExchange

__all__ = ["CPPlan", "RankRole", "STRATEGIES", "StandInExchange", "build_cp_plan", "init_device_mesh", "new_cp_group"]
