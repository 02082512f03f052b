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
    assert "step time (slowest rank): first step" in out and "later steps" in out
    assert elapsed < 120, f"the default demo took {elapsed:.0f} s"


def test_demo_on_one_rank_prints_the_first_step_time():
    """The lead's GPU timing command is `kdacp demo --world-size 1 --device cuda`: one rank must work."""
    proc = _demo("--world-size", "1", "--seq-lens", "100,28", "--steps", "2")
    out, err = proc.communicate(timeout=170)
    assert proc.returncode == 0, err[-3000:]
    rows = [ln.split() for ln in out.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert len(rows) == 1 and rows[0][2:4] == ["128", "2"]  # all tokens, both documents
    first, later = float(rows[0][4]), float(rows[0][5])
    assert first > 0 and later > 0 and "PASS" in out


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
     "--heads must be a positive multiple of --world-size 4, got 6: the MLA layers' Ulysses attention splits"),
    (("demo", "--mode", "hybrid", "--world-size", "4", "--heads", "2"), "multiple of --world-size 4, got 2"),
    (("demo", "--world-size", "2", "--heads", "3"), "multiple of --world-size 2, got 3"),
    (("demo", "--dtype", "float64"), "argument --dtype: invalid choice: 'float64'"),
    (("demo", "--head-dim", "15"), "--head-dim must be even and >= 2"),
    (("demo", "--heads", "0"), "argument --heads: expected a positive integer, got '0'"),
    (("demo", "--steps", "0"), "argument --steps: expected a positive integer"),
    (("demo", "--mode", "ring"), "argument --mode: invalid choice: 'ring'"),
    (("bench", "--suite", "layer", "--device", "cpu", "--backend", "fla"), "--backend fla needs --device cuda"),
    (("bench", "--suite", "layer", "--world-size", "0"), "argument --world-size: expected a positive integer"),
    (("bench", "--suite", "layer", "--seq-lens", "abc"), "argument --seq-lens: expected comma-separated"),
    (("demo", "--mode", "hybrid", "--world-size", "2"), "2 has none (4 or 6 do)"),
    (("demo", "--dtype", "float16"), "argument --dtype: invalid choice: 'float16'"),
    (("demo", "--timeout", "0"), "argument --timeout: expected a positive number of seconds, got '0'"),
    (("demo", "--timeout", "-5"), "argument --timeout: expected a positive number of seconds, got '-5'"),
    (("demo", "--timeout", "nan"), "argument --timeout: expected a positive number of seconds, got 'nan'"),
    (("demo", "--port", "-1"), "argument --port: expected a port number from 0 (pick a free one) to 65535, got '-1'"),
    (("demo", "--port", "99999"), "argument --port: expected a port number from 0"),
    (("bench", "--suite", "layer", "--timeout", "0"), "argument --timeout: expected a positive number of seconds"),
    (("bench", "--suite", "layer", "--port", "abc"), "argument --port: expected a port number from 0"),
    (("bench", "--suite", "virtual", "--batches", "docs7"), "--batches is for --suite cp or layer or gdn, not --suite virtual"),
    (("bench", "--suite", "kernels", "--heads", "4"), "--heads is for --suite layer or scaling, not --suite kernels"),
    (("bench", "--suite", "virtual", "--world-size", "2"), "--world-size is for --suite cp or layer or soak"),
    (("bench", "--suite", "soak", "--trace", "t"), "--trace is for --suite cp, not --suite soak"),
    (("bench",), "the following arguments are required: --suite"),
    ((), "the following arguments are required: command"),
]


@pytest.mark.parametrize("argv,msg", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_exit_2_with_one_line(no_workers, capsys, argv, msg):
    assert msg in _usage_error(capsys, *argv)


def test_demo_fla_without_a_gpu_is_a_usage_error(no_workers, capsys):
    """On a CPU-only machine the default device is the CPU, where FLA's kernels cannot run."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "--backend fla needs --device cuda" in _usage_error(capsys, "demo", "--backend", "fla")


def test_demo_hybrid_runs_with_its_defaults():
    """``--mode hybrid`` without ``--ulysses-size`` once failed inside the workers."""
    proc = _demo("--mode", "hybrid", "--steps", "1")
    out, err = proc.communicate(timeout=170)
    assert proc.returncode == 0, err[-3000:]
    assert "mode hybrid (ulysses_size 2, strategy p2p)" in out and "PASS" in out


@pytest.mark.parametrize("world_size,mode,heads,ulysses_size", [
    (4, "state", 4, None), (4, "ulysses", 4, None), (4, "hybrid", 4, 2), (1, "state", 4, None),
    (1, "ulysses", 4, None), (3, "state", 6, None), (8, "ulysses", 8, None), (9, "hybrid", 9, 3)])
def test_demo_defaults_fit_every_mode(world_size, mode, heads, ulysses_size):
    from kdacp.demo import demo_config
    cfg = demo_config(world_size, mode, seq_lens=(100 * world_size, 28 * world_size))
    cfg.validate()
    assert (cfg.num_heads, cfg.head_dim, cfg.ulysses_size) == (heads, 16, ulysses_size)
    gpu = demo_config(world_size, mode, device="cuda", seq_lens=(100 * world_size,))
    assert (gpu.num_heads, gpu.head_dim) == ({3: 33, 9: 36}.get(world_size, 32), 128)


def test_demo_help_shows_defaults(capsys):
    from kdacp.cli import main
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert e.value.code == 0
    for default in ("default: 600,250,900,298", "default: state", "default: p2p", "default: auto", "default: 3)",
                    "default: 4 on CPU", "default: float32 on CPU", "default: 4 on CPU, 32 on CUDA",
                    "default: 16 on CPU",
                    "default: the smallest"):
        assert default in out, default


def test_demo_names_mode_and_strategy():
    from kdacp.demo import demo_config
    assert demo_config(4, "state", strategy="allgather").describe().startswith(
        "4 ranks, mode state (strategy allgather), Kimi Linear (KDA, MLA, KDA; 4 heads of 16), float32")
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
    assert calls[-1] == ("cp", dict(t_locals=(1024,), family="kda", trace_dir=str(tmp_path / "t")))
    main(["bench", "--suite", "cp", "--family", "gdn", "--seq-lens", "1024", "--world-size", "2", "--out", str(tmp_path)])
    assert calls[-1] == ("cp", dict(t_locals=(1024,), family="gdn"))
    assert main(["bench", "--suite", "layer", "--family", "gdn", "--out", str(tmp_path)]) == 2
    assert "--family is for --suite kernels or cp, not --suite layer" in capsys.readouterr().err
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
