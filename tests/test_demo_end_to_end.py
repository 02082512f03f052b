"""`kdacp demo` end to end, as a user runs it (a fresh process): passes with its defaults, on one rank and in
every mode, reports where its wall time went and what `auto` chose, and fails fast and clean when a worker
dies, the port is taken or the GPU is missing."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.multiprocess import run_command


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _is_worker(pid: int) -> bool:
    try:
        return b"multiprocessing" in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:  # exited since ps listed it
        return False


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"  # a zombie has exited
    except OSError:
        return False


def _demo(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kdacp.cli", "demo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _time_line(out: str) -> tuple[float, dict]:
    """The whole command's time and its parts (name -> seconds) from the demo's ``time:`` line."""
    line = next(ln for ln in out.splitlines() if ln.startswith("time: "))
    whole = float(re.match(r"time: ([0-9.]+) s from command to verdict: ", line).group(1))
    parts = {name.strip(): float(x) for x, name in re.findall(r"([0-9.]+) s ([^,()]+)", line.split(": ", 2)[2])}
    return whole, parts


def test_demo_defaults_pass_within_two_minutes():
    start = time.monotonic()
    proc = _demo()
    out, err = proc.communicate(timeout=170)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, err[-3000:]
    assert "PASS" in out
    lines = [ln for ln in out.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert len(lines) == 4  # one row per rank of the default world size
    assert "step time (slowest rank): first step" in out and "later steps" in out
    assert elapsed < 120, f"the default demo took {elapsed:.0f} s"


def test_demo_on_one_rank_reports_its_whole_time_and_choices():
    """The lead's GPU timing command is `kdacp demo --world-size 1 --device cuda`: one rank must work, and
    the time it prints must be the whole command's, from its entry (before it imports torch), with what it went
    to."""
    start = time.monotonic()
    proc = _demo("--world-size", "1", "--seq-lens", "100,28", "--steps", "2", "--strategy", "auto")
    out, err = proc.communicate(timeout=170)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, err[-3000:]
    assert out.startswith("demo: 1 rank, mode state") and "backend auto (torch)" in out.splitlines()[0]
    rows = [ln.split() for ln in out.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert len(rows) == 1 and rows[0][2:4] == ["128", "2"]  # all tokens, both documents
    first, later = float(rows[0][4]), float(rows[0][5])
    assert first > 0 and later > 0 and "PASS" in out
    assert "--strategy auto: no state is passed in this mode" in out
    whole, parts = _time_line(out)
    assert elapsed - 5 < whole <= elapsed, (whole, elapsed)  # less the interpreter's start and the exit
    assert set(parts) == {"imports and set-up", "starting 1 rank", "building the model", "context-parallel steps",
                          "compiling ahead", "autotuning", "the one-process reference", "checks",
                          "results and the process group's end"}, parts
    assert parts["context-parallel steps"] >= first  # the first step is one of them
    top = sum(v for k, v in parts.items() if k not in ("compiling ahead", "autotuning"))
    assert abs(top - whole) < 1.0, (top, whole)  # the parts add up to the whole (each rounded to 0.1 s)


@pytest.mark.slow  # tests/test_workers.py covers a dying rank and a killed launcher in the default run
def test_demo_reports_a_killed_worker_and_leaves_no_process():
    proc = _demo("--world-size", "2", "--steps", "50", "--mode", "ulysses", "--seq-lens", "100,156")
    deadline = time.monotonic() + 90
    workers: list[int] = []
    while time.monotonic() < deadline:  # wait until both workers run
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        workers = _children(proc.pid)
        workers = [w for w in workers if _is_worker(w)]
        if len(workers) >= 2:
            break
        time.sleep(0.5)
    assert len(workers) >= 2, "the demo did not start its workers"
    time.sleep(8)  # let them get into the training loop
    killed_at = time.monotonic()
    os.kill(workers[-1], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert time.monotonic() - killed_at < 30
    assert "died (signal SIGKILL)" in err
    time.sleep(1)
    alive = [w for w in workers if _running(w)]
    assert not alive, f"workers left running: {alive}"


# slow: tests/test_cli_usage.py checks this refusal and its exit status in-process; the busy-port test below
# checks a usage error's exit status through the real entry point
@pytest.mark.slow
def test_demo_rejects_a_split_that_does_not_divide():
    proc = _demo("--world-size", "3", "--seq-lens", "100,102")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "cannot split equally" in err


@pytest.mark.slow  # as above
@pytest.mark.parametrize("args,msg", [(("--device", "cuda"), "no CUDA GPU is visible")])
def test_demo_explains_missing_gpu(args, msg):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = _demo(*args)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and msg in err and out == ""


def test_demo_explains_a_busy_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = _demo("--world-size", "2", "--port", str(s.getsockname()[1]))
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "is in use" in err and "--port 0" in err and out == ""


def test_demo_under_torchrun_uses_its_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "kdacp.cli", "demo",
           "--seq-lens", "100,156", "--steps", "1"]
    out = run_command(cmd, 180)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [ln for ln in out.stdout.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert len(rows) == 2 and "PASS" in out.stdout


@pytest.mark.slow
def test_demo_hybrid_runs_with_its_defaults():
    """``--mode hybrid`` without ``--ulysses-size`` once failed inside the workers."""
    proc = _demo("--mode", "hybrid", "--steps", "1", "--strategy", "auto")
    out, err = proc.communicate(timeout=170)
    assert proc.returncode == 0, err[-3000:]
    assert "mode hybrid (ulysses_size 2, strategy auto)" in out and "PASS" in out
    assert re.search(r"--strategy auto: chose (p2p|allgather|scan) \(auto: ", out), out




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_demo_first_run_on_an_empty_triton_cache_takes_under_30_s_on_hopper(tmp_path):
    """On an H100 or H200 the demo's first run, as a new user makes it (a fresh process, an empty Triton
    cache, no configurations of the user's), passes within 30 s: FLA takes kdacp's shipped
    configurations, the GPU's own or its nearest sibling's, instead of autotuning every kernel shape
    (minutes)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("kdacp ships configurations for Hopper GPUs (sm_90) only")
    from kdacp.backends.fla_adapter import fla_available
    if not fla_available():
        pytest.skip("fla-core 0.6.0 is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE", "XDG_CACHE_HOME")}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), HOME=str(tmp_path))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kdacp_command", "demo", "--world-size", "1", "--device", "cuda"],
                          env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stderr[-3000:]
    assert elapsed < 30, f"the first run took {elapsed:.0f} s on the {torch.cuda.get_device_name()}: " + \
        next((ln for ln in proc.stdout.splitlines() if ln.startswith("time: ")), "")
