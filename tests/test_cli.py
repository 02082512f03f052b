"""`kdacp demo` end to end: passes with its defaults, and fails fast and clean when a worker dies."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch


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


def test_demo_defaults_pass_within_two_minutes():
    start = time.monotonic()
    proc = _demo()
    out, err = proc.communicate(timeout=170)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, err[-3000:]
    assert "PASS" in out
    lines = [ln for ln in out.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert len(lines) == 4  # one row per rank of the default world size
    assert elapsed < 120, f"the default demo took {elapsed:.0f} s"


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


def test_demo_rejects_a_split_that_does_not_divide():
    proc = _demo("--world-size", "3", "--seq-lens", "100,102")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "cannot split equally" in err


@pytest.mark.parametrize("args,msg", [(("--device", "cuda"), "no CUDA GPU is visible")])
def test_demo_explains_missing_gpu(args, msg):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = _demo(*args)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and msg in err


def test_demo_explains_a_busy_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = _demo("--world-size", "2", "--port", str(s.getsockname()[1]))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "is in use" in err and "--port 0" in err


def test_demo_under_torchrun_uses_its_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "kdacp.cli", "demo",
           "--seq-lens", "100,156", "--steps", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [ln for ln in out.stdout.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert len(rows) == 2 and "PASS" in out.stdout


@pytest.fixture
def no_workers(monkeypatch):
    """Fails a test that gets as far as starting workers: usage errors must stop before."""
    import kdacp.cli

    def launch(*args, **kwargs):
        raise AssertionError("workers were started")
    monkeypatch.setattr(kdacp.cli, "launch", launch)


def _usage_error(capsys, *argv) -> str:
    """Run the CLI in-process; assert exit status 2 and return stderr's last line."""
    from kdacp.cli import main
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "Traceback" not in captured.err and "%" not in captured.err  # no progress bar either
    return captured.err.strip().splitlines()[-1]


USAGE_ERRORS = [
    (("demo", "--world-size", "0"), "argument --world-size: expected a positive integer, got '0'"),
    (("demo", "--world-size", "-2"), "argument --world-size: expected a positive integer, got '-2'"),
    (("demo", "--seq-lens", "abc"), "argument --seq-lens: expected comma-separated positive integers"),
    (("demo", "--seq-lens", ""), "argument --seq-lens: expected comma-separated positive integers"),
    (("demo", "--seq-lens", "100,-4"), "argument --seq-lens: expected comma-separated positive integers"),
    (("demo", "--world-size", "3", "--seq-lens", "100,102"), "which 3 ranks cannot split equally"),
    (("demo", "--device", "cpu", "--backend", "fla"), "--backend fla needs --device cuda"),
    (("demo", "--mode", "hybrid", "--world-size", "3", "--seq-lens", "300"), "3 has none (4 or 6 do)"),
    (("demo", "--mode", "hybrid", "--world-size", "4", "--ulysses-size", "3"),
     "--ulysses-size 3 must divide --world-size 4 and lie strictly between 1 and 4"),
    (("demo", "--mode", "hybrid", "--world-size", "4", "--ulysses-size", "4"), "--ulysses-size 4 must divide"),
    (("demo", "--mode", "state", "--ulysses-size", "2"), "--ulysses-size is for --mode hybrid only"),
    (("demo", "--mode", "ulysses", "--world-size", "4", "--heads", "6"),
     "--mode ulysses splits each layer's heads over 4 ranks, so --heads must be a positive multiple of 4; got 6"),
    (("demo", "--mode", "hybrid", "--world-size", "4", "--heads", "3"), "heads over 2 ranks"),
    (("demo", "--heads", "0"), "argument --heads: expected a positive integer, got '0'"),
    (("demo", "--steps", "0"), "argument --steps: expected a positive integer"),
    (("demo", "--mode", "ring"), "argument --mode: invalid choice: 'ring'"),
    (("bench", "--suite", "layer", "--device", "cpu", "--backend", "fla"), "--backend fla needs --device cuda"),
    (("bench", "--suite", "layer", "--world-size", "0"), "argument --world-size: expected a positive integer"),
    (("bench", "--suite", "layer", "--seq-lens", "abc"), "argument --seq-lens: expected comma-separated"),
]


@pytest.mark.parametrize("argv,msg", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_exit_2_with_one_line(no_workers, capsys, argv, msg):
    assert msg in _usage_error(capsys, *argv)


@pytest.mark.parametrize("mode,heads,ulysses_size", [("state", 2, None), ("ulysses", 4, None), ("hybrid", 2, 2)])
def test_demo_defaults_fit_every_mode(mode, heads, ulysses_size):
    from kdacp.demo import demo_config
    cfg = demo_config(4, mode)
    cfg.validate()
    assert (cfg.num_heads, cfg.num_v_heads, cfg.ulysses_size) == (heads, 2 * heads, ulysses_size)
    assert demo_config(8, "ulysses").num_heads == 8 and demo_config(9, "hybrid").ulysses_size == 3


def test_demo_help_shows_defaults(capsys):
    from kdacp.cli import main
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert e.value.code == 0
    for default in ("default: 600,250,900,298", "default: state", "default: p2p", "default: auto", "default: 3)",
                    "default: 4 on CPU", "default: float64 on CPU", "default: 2,", "default: the smallest"):
        assert default in out, default


def test_demo_names_mode_and_strategy():
    from kdacp.demo import demo_config
    assert demo_config(4, "state", strategy="allgather").describe().startswith(
        "4 ranks, mode state (strategy allgather), 2 q/k heads, 4 value heads")
    assert "mode hybrid (ulysses_size 2, strategy p2p)" in demo_config(4, "hybrid").describe()


def test_bench_layer_on_cpu_defaults_to_cpu_sizes(monkeypatch, tmp_path, capsys):
    """The command the CLI suggests without a GPU: at these sizes it ran in 19 s on 2 cores (at the GPU
    sizes, no row in 300 s)."""
    import kdacp.bench
    from kdacp.cli import main
    calls = []

    def run_suite(name, case, **kwargs):
        calls.append((name, case, kwargs["device"]))
        return [dict(run="one_gpu", gpus=1, tokens_per_gpu=case["t_local"], global_tokens=case["t_local"], ms=1.0)]
    monkeypatch.setattr(kdacp.bench, "run_suite", run_suite)
    assert main(["bench", "--suite", "layer", "--device", "cpu", "--backend", "torch", "--out", str(tmp_path)]) == 0
    assert calls == [("layer", dict(t_local=256, backend="torch", hidden=128, heads=4, head_dim=32, warmup=1, iters=3),
                      "cpu")]
    main(["bench", "--suite", "layer", "--device", "cpu", "--heads", "2", "--seq-lens", "64", "--out", str(tmp_path)])
    assert calls[-1][1] == dict(t_local=64, backend="torch", hidden=128, heads=2, head_dim=32, warmup=1, iters=3)


def test_bench_batches_and_trace_reach_the_suite(monkeypatch, tmp_path, capsys):
    import kdacp.bench
    from kdacp.cli import main
    calls = []

    def run_suite(name, case, **kwargs):
        calls.append((name, case))
        return [dict(batch="docs7", label="x", ms=1.0, kdacp_cp_ratio=1.0)]
    monkeypatch.setattr(kdacp.bench, "run_suite", run_suite)
    main(["bench", "--suite", "layer", "--device", "cpu", "--batches", "docs7,lognormal", "--out", str(tmp_path)])
    assert calls[-1][1]["batches"] == ("docs7", "lognormal")
    import kdacp.bench.harness
    monkeypatch.setattr(kdacp.bench.harness, "run_context",
                        lambda: dict(date="d", device="gpu", gpus=2, torch="t", triton="t", commit="c"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as if on the GPU machine
    main(["bench", "--suite", "cp", "--trace", str(tmp_path / "t"), "--seq-lens", "1024", "--world-size", "2",
          "--out", str(tmp_path)])
    assert calls[-1] == ("cp", dict(t_locals=(1024,), trace_dir=str(tmp_path / "t")))
    with pytest.raises(SystemExit) as e:
        main(["bench", "--suite", "cp", "--batches", "nope"])
    assert e.value.code == 2 and "--batches: expected comma-separated names" in capsys.readouterr().err


def test_bench_gdn_runs_on_one_rank(monkeypatch, tmp_path):
    import kdacp.bench
    import kdacp.bench.harness
    from kdacp.cli import main
    calls = []

    def run_suite(name, case, **kwargs):
        calls.append((name, case, kwargs["world_size"]))
        return [dict(batch="docs7", label="x", kdacp_ratio=1.0)]
    monkeypatch.setattr(kdacp.bench, "run_suite", run_suite)
    monkeypatch.setattr(kdacp.bench.harness, "run_context",
                        lambda: dict(date="d", device="gpu", gpus=8, torch="t", triton="t", commit="c"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as if on the GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    main(["bench", "--suite", "gdn", "--batches", "one_sequence", "--out", str(tmp_path)])
    assert calls[-1] == ("gdn", dict(t_locals=(16384, 32768), batches=("one_sequence",)), 1)
