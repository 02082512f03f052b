"""Benchmark suites behind ``kdacp bench``: ``kernels`` (summary kernels on one GPU), ``cp``
(``chunk_kda`` against one GPU and FLA's CP), ``gdn`` (GDN on one GPU against FLA's), ``layer``
(the layer against FLA's, and its CP modes), ``virtual`` (each strategy's accuracy at 2 to 1024
virtual ranks, one device), ``soak`` (a long training run, watching memory, threads, files and
caches), ``scaling`` (each strategy's step at 2 to 1024 ranks, predicted from stage and link times
measured here; with several ranks, also measured), ``overhead`` (each rank role's forward and
backward over one device's on the same tokens, and the stages behind the difference), ``hybrid`` (a hybrid
model's step per token layout and attention exchange, predicted) and ``balance`` (causal attention of every
rank of each layout, timed on one device).

Each suite module defines ``run(..., report=None) -> list[dict]`` (``report(row)`` as each row is
measured) and ``PLOTS`` (file stem -> :class:`~kdacp.bench.harness.PlotSpec`), and may define
``markdown(rows) -> str``; multi-rank suites set ``MULTI_RANK = True`` and their ``run`` is called on
every rank of an initialised process group, after the suite's optional ``prepare()`` (imports that must
come before the group, as :func:`kdacp.workers.launch` explains).
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Callable

from ..choices import CPU_SUITES, SUITES
from ..workers import WorkerRank, deadline, launch

__all__ = ["SUITES", "CPU_SUITES", "load_suite", "run_suite"]



def load_suite(name: str) -> ModuleType:
    if name not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def _prepare(name: str) -> None:
    """In each rank's process before its group: import the suite and run its ``prepare()``, if any."""
    prepare = getattr(load_suite(name), "prepare", None)
    if prepare is not None:
        prepare()


def _rank_worker(worker: WorkerRank, name: str, options: dict) -> list[dict]:
    suite = load_suite(name)
    report = worker.report if worker.rank == 0 else None
    return suite.run(**options, device=str(worker.device), report=report)


def run_suite(name: str, options: dict, *, device: str = "cuda", world_size: int = 1, port: int = 0,
              timeout_s: float = 1800.0, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Run one suite (spawning ``world_size`` ranks for a multi-rank suite) and return rank 0's rows.

    Raises:
        kdacp.workers.WorkerError: the suite passed ``timeout_s`` (a suite of one process is stopped in it, by
            :func:`kdacp.workers.deadline`), or a rank failed."""
    suite = load_suite(name)
    if not getattr(suite, "MULTI_RANK", False):
        with deadline(timeout_s):
            return suite.run(**options, device=device, report=on_row)
    results = launch(_rank_worker, world_size, (name, options), device=device, port=port, timeout_s=timeout_s,
                     on_report=lambda rank, row: on_row and on_row(row), prepare=functools.partial(_prepare, name))
    return results[0]
