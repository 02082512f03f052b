"""Context parallelism over ``torch.distributed``: everything that splits a sequence across ranks.

For the ops: build a :class:`CPPlan` once per batch with :func:`build_cp_plan`, then call
:func:`kdacp.chunk_kda` (or :func:`kdacp.chunk_gated_delta_rule`) with ``cp=plan`` on every rank with that
rank's tokens. Give both a group from :func:`new_cp_group` (created once, at start-up): its NCCL streams have
high priority, which keeps the state exchange off the compute kernels' queue, and it keeps kdacp's messages
out of the queue of other collectives (gradient all-reduces) on the default group.

For the layers: :class:`ContextParallel` (from a group or a ``DeviceMesh``) is a layer's context-parallel
mode; it builds each batch's :class:`CPContext` (:func:`build_cp_context`: plan, local boundaries, halo
routes) once and hands it to the layers' hooks (:mod:`.hooks`).

Modules: :mod:`.layout` (token layouts), :mod:`.plan` (the partition plan), :mod:`.exchanges` (the state
exchanges), :mod:`.schedule` (each rank's forward and backward), :mod:`.split` (a rank's pieces),
:mod:`.checks` (cross-rank checks), :mod:`.collectives` and :mod:`.autograd_collectives` (raw and
differentiable calls), :mod:`.cost_model` (the exchanges' cost model), :mod:`.groups` (process groups),
:mod:`.context`, :mod:`.batch_context` and :mod:`.hooks` (the layers' mode, per-batch context and hooks).
"""
from .groups import init_device_mesh
from .groups import new_group as new_cp_group
from .plan import STRATEGIES, CPPlan, build_cp_plan
from .batch_context import CPContext, build_cp_context
from .context import ContextParallel

__all__ = ["CPContext", "CPPlan", "ContextParallel", "STRATEGIES", "build_cp_context", "build_cp_plan",
           "init_device_mesh", "new_cp_group"]
