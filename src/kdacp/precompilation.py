"""Compile a step's Triton kernels in parallel before it first runs.

A fresh machine spends the first training step compiling Triton kernels one at a time (kdacp's and
FLA's: 20 distinct kernels for ``kdacp demo``'s Kimi Linear model; benchmarks/RESULTS.md, "Demo cold
start"). Triton compiles a kernel the first time it is launched, so the step's host
thread waits on each compilation in turn.
:func:`precompile` runs the step once as a *dry run*: each launch of a kernel not yet compiled is
skipped and its compilation (with its C launcher) is handed to a pool of threads; Triton's compiler
releases the GIL for most of its work, and ``ptxas`` and the launcher's C compiler are processes of
their own. At the end it waits for the pool; the kernels then sit in Triton's in-memory and on-disk
caches, and the real first step launches them with no compile wait.

The dry run's numbers are garbage: a skipped kernel writes nothing, so everything downstream of it
(outputs, losses, gradients, collectives' payloads) is meaningless. The caller discards what the step
left behind (``model.zero_grad(set_to_none=True)``) and must not let it take an optimizer step.
Non-Triton operations (PyTorch, cuBLAS, NCCL) run for real, so a step that indexes memory with values
computed by a Triton kernel cannot be dry-run. An autotuned kernel whose tuning is not cached is skipped
(timing skipped launches would cache a meaningless choice); the real step tunes it. With ``configs=True`` the dry
run compiles every configuration of such a kernel in the pool first, so that the real step's autotuning only
times them: Triton's autotuner compiles its configurations one after another as it first times each (a kernel
of FLA's KDA backward with 20 of them took 64 s to tune on an H100, most of it compiling), which is what makes
``kdacp tune`` take minutes.
"""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

__all__ = ["precompile"]


class _Untuned(Exception):
    """Raised inside an autotuner during a dry run instead of benchmarking skipped launches."""


def _compiles_kernels(device: torch.device | str | None) -> bool:
    """Whether Triton compiles kernels for ``device`` (a CUDA device, not the interpreter)."""
    from triton import knobs
    dev = torch.device("cuda" if device is None else device)
    return dev.type == "cuda" and torch.cuda.is_available() and not knobs.runtime.interpret


def precompile(step: Callable[[], Any], *, threads: int | None = None,
               device: torch.device | str | None = None, configs: bool = False) -> int:
    """Dry-run ``step()`` (see the module docstring) and compile, ``threads`` at a time (default: the
    CPU count, at most 32), every Triton kernel its launches would compile, and with ``configs`` every
    configuration of each autotuned kernel not yet tuned; returns the number of kernels compiled. Returns 0
    without running ``step`` where no kernels are compiled (``device`` not CUDA, no GPU, or
    ``TRITON_INTERPRET=1``). Re-raises the first compilation error, except a configuration's (the real step's
    autotuning meets it again, and drops that configuration as it does).

    Launches from every thread are intercepted (autograd runs CUDA backward on a thread of its own), so
    run nothing else that launches Triton kernels meanwhile. Call it on every rank of a distributed
    step (its collectives run, on garbage), then discard the step's side effects before the real one."""
    if not _compiles_kernels(device):
        return 0
    threads = threads or min(32, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads, thread_name_prefix="kdacp-precompile") as pool:
        with _dry_launches(pool, configs) as futures:
            step()
        for future in futures:
            future.result()
        return len(futures)


@contextlib.contextmanager
def _dry_launches(pool: ThreadPoolExecutor, configs: bool = False):
    """Within: a launch (from any thread) that would compile submits the compilation to ``pool`` and is
    skipped; untuned autotuners are skipped, each of their configurations' launches submitted first where
    ``configs``. Yields the list of submitted compilations."""
    from triton import knobs
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.driver import driver

    futures: list[Future] = []
    submitted: set[tuple[int, str]] = set()
    lock = threading.Lock()
    user_hook = knobs.runtime.jit_cache_hook

    def compile_and_build_launcher(jit_function, compile_args):
        torch.cuda.set_device(compile_args["device"])
        kernel = jit_function.preload(compile_args["specialization_data"])  # our hook lets it through
        driver.active.launcher_cls(kernel.src, kernel.metadata)  # builds and caches the C launcher
        return kernel

    tuning = threading.local()  # .active: the launches of an untuned autotuner's configurations, on this thread

    def compile_config(jit_function, compile_args):
        try:
            return compile_and_build_launcher(jit_function, compile_args)
        except Exception:  # noqa: BLE001 - a configuration that does not compile is the real autotuning's to drop
            return None

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        if user_hook is not None and user_hook(key=key, repr=repr, fn=fn, compile=compile,
                                               is_manual_warmup=is_manual_warmup,
                                               already_compiled=already_compiled):
            return True
        if is_manual_warmup:
            return None  # a preload (ours, in the pool) or the user's own warmup: compile as usual
        marker = (id(fn.jit_function), key)
        with lock:
            if marker not in submitted:
                submitted.add(marker)
                job = compile_config if getattr(tuning, "active", False) else compile_and_build_launcher
                futures.append(pool.submit(job, fn.jit_function, compile))
        return True  # skip this launch

    real_run, real_bench = Autotuner.run, Autotuner._bench

    def run(self, *args, **kwargs):
        try:
            return real_run(self, *args, **kwargs)
        except _Untuned:
            return None

    def bench(self, *args, config, **meta):
        if configs:  # each configuration's launch, as the autotuner's own timing makes it: compiled, skipped
            tuning.active = True
            try:
                for each in self.configs:
                    try:
                        self.fn.run(*args, **dict(meta, **each.all_kwargs()))
                    except Exception:  # noqa: BLE001 - one that cannot launch is the real autotuning's to drop
                        pass
            finally:
                tuning.active = False
        raise _Untuned

    knobs.runtime.jit_cache_hook = hook
    Autotuner.run, Autotuner._bench = run, bench
    try:
        yield futures
    finally:
        knobs.runtime.jit_cache_hook = user_hook
        Autotuner.run, Autotuner._bench = real_run, real_bench
