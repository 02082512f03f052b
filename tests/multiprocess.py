"""Run a test function on several real ranks (separate processes): gloo on CPU or NCCL, a free local
port, and a hard deadline, so a failing rank fails the test fast instead of hanging it; and run a launcher
command (torchrun, a script) whose whole process group is killed if it outlives its deadline."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kdacp.workers import free_port

# Ranks on CPU fork from one server process that imported these once ("forkserver"), instead of each starting a
# fresh interpreter that imports them again (seconds per rank on 2 cores). The server starts with this
# process's environment (TRITON_INTERPRET from tests/conftest.py included) and nothing else of its state, like
# a spawned rank. NCCL ranks are spawned: a GPU context must not be inherited.
multiprocessing.set_forkserver_preload([
    "torch", "torch.distributed", "kdacp", "tests.multiprocess", "transformers",
    "transformers.models.kimi_linear.modeling_kimi_linear", "transformers.models.qwen3_next.modeling_qwen3_next"])


def _entry(rank: int, world_size: int, port: int, backend: str, fn, args) -> None:
    torch.set_num_threads(1)  # ranks share the machine's few cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any rank imports triton
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=90))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # A rank that is done skips interpreter finalization: a rank that imported transformers' model code
    # after init_process_group still holds the default group then (transformers keeps it), and destroying
    # it while Python shuts down aborts the process now and then (SIGABRT, "terminate called without an
    # active exception"; seen in CI at 4 ranks; kdacp.workers.launch's `prepare` is the fix where the
    # imports can come first). A rank that raised exits as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 240.0) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` rank processes; re-raise a rank's error;
    kill all ranks and fail after ``timeout_s``."""
    ctx = mp.start_processes(_entry, args=(world_size, free_port(), backend, fn, args), nprocs=world_size,
                             join=False, start_method="spawn" if backend == "nccl" else "forkserver")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world_size} ranks still running after {timeout_s:.0f} s")


def run_command(cmd: list[str], timeout_s: float, **popen) -> subprocess.CompletedProcess:
    """Run ``cmd`` (output captured as text) in a process group of its own; past ``timeout_s`` kill that whole
    group (a launcher's workers too, which killing the launcher alone would leave running) and raise
    ``TimeoutError`` with the output so far."""
    # process_group=0: setpgid in the child before exec, no Python code there (preexec_fn is unsafe in a process
    # with threads, as torch's); it exists from Python 3.11
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **group, **popen)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise TimeoutError(f"{cmd} still running after {timeout_s:.0f} s:\n{out[-2000:]}{err[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
