"""The command line in-process: usage errors (exit 2, one line, before any worker starts), messages,
help texts and what the bench options hand to the suites."""
import pytest
import torch

@pytest.fixture
def no_workers(monkeypatch):
    """Fails a test that gets as far as starting workers or a suite: usage errors must stop before."""
    import kdacp.bench
    import kdacp.commands

    def launch(*args, **kwargs):
        raise AssertionError("workers were started")
    monkeypatch.setattr(kdacp.commands, "launch", launch)
    monkeypatch.setattr(kdacp.bench, "run_suite", launch)


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
    assert captured.out == ""  # before the demo's header
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 or lines[0].startswith("usage:"), captured.err  # argparse's usage line, then its error
    return lines[-1]


USAGE_ERRORS = [
    (("demo", "--world-size", "0"), "argument --world-size: expected a positive integer, got '0'"),
    (("demo", "--world-size", "-2"), "argument --world-size: expected a positive integer, got '-2'"),
    (("demo", "--seq-lens", "abc"), "argument --seq-lens: expected comma-separated positive integers"),
    (("demo", "--seq-lens", ""), "argument --seq-lens: expected comma-separated positive integers"),
    (("demo", "--seq-lens", "100,-4"), "argument --seq-lens: expected comma-separated positive integers"),
    (("demo", "--world-size", "3", "--seq-lens", "100,102"), "which 3 ranks cannot split equally"),
    (("demo", "--device", "cpu", "--backend", "fla"), "--backend fla needs --device cuda"),
    (("demo", "--device", "cpu", "--backend", "attn_gym"), "--backend attn_gym needs --device cuda"),
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
    (("bench", "--suite", "layer", "--device", "cpu", "--backend", "attn_gym"), "--backend attn_gym needs --device cuda"),
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
    (("bench", "--suite", "virtual", "--batches", "docs7"), "--batches is for --suite cp or layer or gdn or overhead, not --suite virtual"),
    (("bench", "--suite", "kernels", "--heads", "4"),
     "--heads is for --suite layer or scaling or overhead or virtual or hybrid or balance, not --suite kernels"),
    (("bench", "--suite", "layer", "--ranks", "2,4"), "--ranks is for --suite virtual or overhead, not --suite layer"),
    (("bench", "--suite", "virtual", "--ranks", "1,4"), "argument --ranks: expected comma-separated rank counts"),
    (("bench", "--suite", "virtual", "--seq-lens", "100"),
     "--suite virtual takes tokens per rank in multiples of the chunk size 64, got --seq-lens 100"),
    (("bench", "--suite", "virtual", "--seq-lens", "64,128"), "--suite virtual takes one --seq-lens value"),
    (("bench", "--suite", "layer", "--calibration", "s.json"), "--calibration is for --suite hybrid, not --suite layer"),
    (("bench", "--suite", "hybrid", "--calibration", "/nonexistent.json"), "--calibration /nonexistent.json: no such file"),
    (("bench", "--suite", "balance", "--seq-lens", "64,128"), "--suite balance takes one --seq-lens value"),
    (("bench", "--suite", "virtual", "--world-size", "2"), "--world-size is for --suite cp or layer or soak"),
    (("bench", "--suite", "soak", "--trace", "t"), "--trace is for --suite cp, not --suite soak"),
    (("bench", "--suite", "layer", "--modes", "ring"), "argument --modes: expected comma-separated modes from"),
    (("bench", "--suite", "layer", "--device", "cpu", "--modes", "state,hybrid", "--world-size", "2"),
     "the world size needs a divisor between 1 and itself; 2 has none (4 or 6 do)"),
    (("bench", "--suite", "layer", "--device", "cpu", "--modes", "ulysses", "--world-size", "3"),
     "--modes ulysses splits the 4 heads over the ranks of a Ulysses group; 4 do not split"),
    (("bench", "--suite", "cp", "--steps", "5"), "--steps is for --suite soak, not --suite cp"),
    (("bench", "--suite", "soak", "--modes", "state"), "--modes is for --suite layer, not --suite soak"),
    (("bench", "--suite", "soak", "--steps", "0"), "argument --steps: expected a positive integer"),
    (("tune", "--seq-lens", "16384 2048"), "argument --seq-lens: expected comma-separated positive integers"),
    (("demo", "--seq-lens", "4"), "4 tokens, 1 for each of the 4 ranks of the state exchange, fewer than the 3 the "
                                  "short convolution (width 4) takes from the previous rank; make the total at least 12"),
    (("demo", "--mode", "hybrid", "--world-size", "4", "--seq-lens", "4"), "2 for each of the 2 ranks"),
    (("demo", "--world-size", "1024", "--heads", "1024", "--seq-lens", "4096"), "is more than this machine holds"),
    (("bench", "--suite", "layer", "--device", "cpu", "--world-size", "1024"), "is more than this machine holds"),
    (("bench",), "the following arguments are required: --suite"),
    ((), "the following arguments are required: command"),
    (("--bogus",), "unrecognized arguments: --bogus"),
    (("demo", "--seq-lens", "-5,100"), "argument --seq-lens: expected comma-separated positive integers"),
    (("demo", "--seq-lens", "100,-4"), "-4 is not positive"),
    (("tune", "--heads", "-3"), "argument --heads: expected a positive integer, got '-3'"),
]


@pytest.mark.parametrize("argv,msg", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_exit_2_with_one_line(no_workers, capsys, argv, msg):
    assert msg in _usage_error(capsys, *argv)


def test_demo_fla_without_a_gpu_is_a_usage_error(no_workers, capsys):
    """On a CPU-only machine the default device is the CPU, where FLA's kernels cannot run."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "--backend fla needs --device cuda" in _usage_error(capsys, "demo", "--backend", "fla")


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


def _help(capsys, *argv) -> str:
    from kdacp.cli import main
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps the help text


def test_help_texts(capsys):
    top = _help(capsys)
    assert "``" not in top and "kdacp demo (a checked context-parallel training run)" in top
    tune = _help(capsys, "tune")
    assert "(default: None)" not in tune and ") (default:" not in tune
    for text in ("--seq-lens SEQ_LENS comma-separated tokens per call", "(default: 16384,2048)",
                 "--hidden HIDDEN the layer's hidden size (default: 2048)", "--heads HEADS the layer's heads (default: 32)",
                 "--head-dim HEAD_DIM the size of each head, K = V (default: 128)"):
        assert text in tune, text
    bench = _help(capsys, "bench")
    assert "Without a GPU: --suite layer, virtual, soak, scaling" in bench
    assert "folder for the JSON, Markdown and PNG files (default: results)" in bench
    assert "strictly between 1 and it" in _help(capsys, "demo")


def test_tune_takes_comma_separated_lengths():
    from kdacp.cli import build_parser
    assert build_parser().parse_args(["tune", "--seq-lens", "1024,2048"]).seq_lens == (1024, 2048)


def test_tune_help_says_where_the_files_go_and_that_kdacp_prefers_them(capsys):
    from kdacp.backends.fla_configs import USER_CONFIGS
    tune = _help(capsys, "tune").replace("- ", "-")  # argparse wraps after hyphens
    assert f"By default they go to {USER_CONFIGS}/<GPU name>, where kdacp looks first" in tune
    assert "the shapes it does not tune keep the configurations used before" in tune
    assert "instead of the ones it ships" in tune and f"(default: {USER_CONFIGS}/<GPU name>, which kdacp reads" in tune


def test_tune_tunes_the_gates_and_batches_asked_for(monkeypatch, tmp_path, capsys):
    """``--gates`` and ``--batches`` reach :func:`kdacp.tuning.tune` (each gate and batch runs other kernels,
    so a first run's shapes can be tuned alone), and the last line says where the files went and who reads them."""
    import kdacp.tuning
    from kdacp.cli import main
    seen = {}

    def tune(out, **kwargs):
        seen.update(kwargs, out=out)
        return [tmp_path / "NVIDIA_H100_80GB_HBM3" / "chunk_fwd_kernel_o.json"]
    monkeypatch.setattr(kdacp.tuning, "tune", tune)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["tune", "--gates", "softplus", "--batches", "docs7", "--seq-lens", "2048"]) == 0
    assert seen["gates"] == (None,) and seen["batches"] == ("docs7",) and seen["t_local"] == (2048,)
    assert seen["out"] is None
    folder = tmp_path / "NVIDIA_H100_80GB_HBM3"
    assert capsys.readouterr().out.strip() == (f"wrote 1 FLA configuration files into {folder}; "
                                               "kdacp uses them on this GPU from now on")
    assert main(["tune", "--gates", "safe,softplus"]) == 0 and seen["gates"] == (-5.0, None)
    assert seen["batches"] == ("one_sequence", "docs7")  # the default: both kinds of batch
    capsys.readouterr()
    error = _usage_error(capsys, "tune", "--gates", "none")
    assert "expected comma-separated gates from safe, softplus, got 'none'" in error


def test_bench_device_cuda_without_a_gpu_names_the_missing_gpu(no_workers, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert _usage_error(capsys, "bench", "--suite", "layer", "--device", "cuda") == (
        "kdacp bench: --device cuda was asked for but no CUDA GPU is visible; --suite layer also runs with --device cpu")
    assert "--suite kernels needs a CUDA GPU and none is visible" in _usage_error(capsys, "bench", "--suite", "kernels")


def test_demo_device_cuda_without_a_gpu_is_a_usage_error(no_workers, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "--device cuda was asked for but no CUDA GPU is visible" in _usage_error(capsys, "demo", "--device", "cuda")


def test_a_busy_port_is_a_usage_error(no_workers, capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        assert f"port {port} is in use" in _usage_error(capsys, "demo", "--world-size", "2", "--port", port)
        assert "is in use" in _usage_error(capsys, "bench", "--suite", "layer", "--device", "cpu", "--port", port)


def test_bench_fla_without_fla_is_a_usage_error(no_workers, capsys, monkeypatch):
    """On a machine with a GPU but without FLA (a GPU is faked here: the check stops before any kernel)."""
    from kdacp.backends.fla_adapter import fla_available
    if fla_available():
        pytest.skip("FLA is installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert "--backend fla: " in _usage_error(capsys, "bench", "--suite", "layer", "--device", "cuda", "--backend", "fla")


def test_bench_keeps_the_rows_of_a_run_stopped_early(monkeypatch, tmp_path, capsys):
    """A soak (or any suite) stopped by its --timeout keeps the rows measured until then, on disk as each
    was measured."""
    import json

    import kdacp.bench
    from kdacp.cli import main
    from kdacp.workers import WorkerError
    seen_on_disk = []

    def run_suite(name, case, *, on_row, **kwargs):
        assert case == {"steps": 40}
        for step in (1, 2):
            on_row(dict(step=step, rss_MB=100.0))
            seen_on_disk.append(len(json.loads((tmp_path / "soak.json").read_text())["rows"]))
        raise WorkerError("the run passed its 90 s limit; all workers were stopped")
    monkeypatch.setattr(kdacp.bench, "run_suite", run_suite)
    assert main(["bench", "--suite", "soak", "--steps", "40", "--timeout", "90", "--out", str(tmp_path)]) == 1
    assert seen_on_disk == [1, 2]
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["complete"] is False and [r["step"] for r in data["rows"]] == [1, 2]
    assert "Partial: the 2 rows" in (tmp_path / "soak.md").read_text()
    captured = capsys.readouterr()
    assert "kept the 2 rows measured before the run stopped" in captured.out
    assert captured.err.strip().splitlines()[-1] == "kdacp bench: the run passed its 90 s limit; all workers were stopped"


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
    assert demo_config(1).describe().startswith("1 rank, mode state")
    assert "backend auto (torch)" in demo_config(2).describe()
    assert "backend torch," in demo_config(2, backend="torch").describe()
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
    import types

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
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2 ** 30))
    main(["bench", "--suite", "cp", "--trace", str(tmp_path / "t"), "--seq-lens", "1024", "--world-size", "2",
          "--out", str(tmp_path)])
    assert calls[-1] == ("cp", dict(t_locals=(1024,), family="kda", trace_dir=str(tmp_path / "t")))
    main(["bench", "--suite", "cp", "--family", "gdn", "--seq-lens", "1024", "--world-size", "2", "--out", str(tmp_path)])
    assert calls[-1] == ("cp", dict(t_locals=(1024,), family="gdn"))
    main(["bench", "--suite", "layer", "--family", "gdn", "--seq-lens", "1024", "--world-size", "1", "--out",
          str(tmp_path)])
    assert calls[-1][0] == "layer" and calls[-1][1]["family"] == "gdn"
    assert main(["bench", "--suite", "gdn", "--family", "gdn", "--out", str(tmp_path)]) == 2
    assert "--family is for --suite kernels or cp or overhead or layer, not --suite gdn" in capsys.readouterr().err
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


def test_bench_virtual_sizes_reach_the_suite(monkeypatch, tmp_path):
    import kdacp.bench
    from kdacp.cli import main
    calls = []

    def run_suite(name, case, **kwargs):
        calls.append((name, case, kwargs["timeout_s"]))
        return [dict(P=2, T=128)]
    monkeypatch.setattr(kdacp.bench, "run_suite", run_suite)
    assert main(["bench", "--suite", "virtual", "--out", str(tmp_path)]) == 0
    assert calls[-1] == ("virtual", {}, 1800.0)
    assert main(["bench", "--suite", "virtual", "--ranks", "2,8", "--seq-lens", "128", "--heads", "1", "--head-dim",
                 "8", "--timeout", "30", "--out", str(tmp_path)]) == 0
    assert calls[-1] == ("virtual", dict(world_sizes=(2, 8), tokens_per_rank=128, HV=1, K=8, V=8), 30.0)


def test_a_suite_of_one_process_stops_at_its_timeout():
    """The virtual suite at 256 ranks takes half a minute or more here; its --timeout of 2 s stops it."""
    import time
    from kdacp.bench import run_suite
    from kdacp.workers import WorkerError
    rows = []
    start = time.monotonic()
    with pytest.raises(WorkerError, match="passed its 2 s limit"):
        run_suite("virtual", dict(world_sizes=(2, 256)), device="cpu", timeout_s=2.0, on_row=rows.append)
    assert time.monotonic() - start < 10
    assert [row["P"] for row in rows] == [2]  # the rows measured before it are reported


def test_bench_scaling_link_options_reach_the_suite_in_seconds_and_bytes(monkeypatch, tmp_path):
    import kdacp.bench
    from kdacp.cli import main
    calls = []

    def run_suite(name, case, **kwargs):  # the case is all this test wants: no rows
        calls.append(case)
        raise RuntimeError("not run")
    monkeypatch.setattr(kdacp.bench, "run_suite", run_suite)
    main(["bench", "--suite", "scaling", "--device", "cpu", "--link-latency-us", "5", "--link-bandwidth-gbs", "100",
          "--gather-latency-us", "7", "--out", str(tmp_path)])
    assert calls[-1]["link"] == pytest.approx(dict(latency_s=5e-6, bandwidth=1e11, gather_latency_s=7e-6))
    main(["bench", "--suite", "scaling", "--device", "cpu", "--gather-bandwidth-gbs", "2", "--out", str(tmp_path)])
    assert calls[-1]["link"] == dict(gather_bandwidth=2e9)


def test_ctrl_c_while_the_command_imports_prints_one_line(monkeypatch, capsys):
    """The entry point (``kdacp_command``, the ``kdacp`` script's) runs before the package's imports: a Ctrl-C
    arriving while ``kdacp.cli`` loads (faked by a finder that is interrupted there) ends it with one line."""
    import sys

    import kdacp_command

    class Interrupted:
        def find_spec(self, name, path=None, target=None):
            if name == "kdacp.cli":
                raise KeyboardInterrupt
            return None
    monkeypatch.delitem(sys.modules, "kdacp.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    assert kdacp_command.main() == 130
    assert capsys.readouterr().err == "kdacp: interrupted\n"


def test_the_script_entry_point_is_the_command(monkeypatch, capsys):
    import kdacp_command
    monkeypatch.setattr("sys.argv", ["kdacp", "bench"])
    with pytest.raises(SystemExit) as e:
        kdacp_command.main()
    assert e.value.code == 2 and "the following arguments are required: --suite" in capsys.readouterr().err


def test_bench_attn_gym_without_attn_gym_is_a_usage_error(no_workers, capsys, monkeypatch):
    """On a machine with a GPU but without attention-gym (faked GPU; FLA taken as there): the message names it."""
    from kdacp.backends import attn_gym_adapter, fla_adapter
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(fla_adapter, "require_fla", lambda: None)
    monkeypatch.setattr(attn_gym_adapter, "_installed_version", lambda: None)
    attn_gym_adapter._load.cache_clear()
    try:
        message = _usage_error(capsys, "bench", "--suite", "layer", "--device", "cuda", "--backend", "attn_gym")
    finally:
        attn_gym_adapter._load.cache_clear()
    assert "--backend attn_gym: attn-gym is not installed; pip install 'attn-gym[linear]==0.0.17'" in message


def test_demo_help_says_auto_keeps_kda_on_fla(capsys):
    """kdacp.backends.resolve_backend: auto takes attention-gym for GDN only; the demo trains KDA."""
    demo = _help(capsys, "demo")
    assert "auto: on CUDA with FLA installed, fla for KDA, and for GDN attn_gym on a Hopper GPU" in demo
    assert "attn_gym on a Hopper GPU where installed, else fla" not in demo


def test_bench_out_naming_a_file_is_refused_before_the_suite(no_workers, capsys, tmp_path):
    (tmp_path / "afile").touch()
    for out in ("afile", "afile/sub"):
        message = _usage_error(capsys, "bench", "--suite", "hybrid", "--out", str(tmp_path / out))
        assert f"--out {tmp_path / out}: expected a folder" in message and "afile is a file" in message


def test_an_unknown_option_is_named_in_its_command_usage(capsys):
    from kdacp.cli import main
    with pytest.raises(SystemExit) as e:
        main(["demo", "--bogus", "--steps", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: kdacp demo ")
    assert err.strip().splitlines()[-1] == "kdacp demo: error: unrecognized arguments: --bogus"


def test_tune_without_a_gpu_is_a_usage_error(no_workers, capsys, monkeypatch):
    """The exit status of a missing GPU is 2 for every command (bench's: above)."""
    import kdacp.tuning

    def tune(*args, **kwargs):
        raise AssertionError("tuning started")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kdacp.tuning, "tune", tune)
    assert "kdacp tune: needs a CUDA GPU and none is visible" in _usage_error(capsys, "tune")


def test_version_and_the_exit_status_contract(capsys):
    import kdacp
    from kdacp.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"kdacp {kdacp.__version__}\n"
    top = _help(capsys)
    assert ("exit status: 0 success, 1 a failed check or run, 2 a usage error or missing hardware or package "
            "(before anything runs), 130 interrupted") in top


@pytest.mark.parametrize("argv,named", [
    (("demo", "--world-size", "2", "--seq-lens", "100000000000"), "--seq-lens (100000000000 tokens)"),
    (("demo", "--world-size", "2", "--heads", "10000000"), "--heads 10000000"),
    (("bench", "--suite", "layer", "--device", "cpu", "--seq-lens", "10000000000"), "--seq-lens 10000000000"),
    (("bench", "--suite", "layer", "--device", "cpu", "--heads", "10000000"), "--heads 10000000")])
def test_sizes_that_cannot_fit_are_refused_before_any_worker(no_workers, capsys, argv, named):
    message = _usage_error(capsys, *argv)
    assert named in message and "need at least" in message and "GB of memory are available" in message


def test_the_memory_estimate_passes_the_default_sizes():
    from kdacp.bench.layer import memory_bytes
    from kdacp.demo import DemoConfig
    assert 1e6 < DemoConfig().memory_bytes() < 1e8  # the default demo: well under its measured 1 GB a rank
    assert 1e5 < memory_bytes(2, t_local=256, hidden=128, heads=4, head_dim=32) < 1e8


def test_a_worker_killed_by_sigkill_names_the_out_of_memory_killer():
    import signal

    from kdacp.workers import exit_cause
    assert exit_cause(-signal.SIGKILL) == "signal SIGKILL, most often the out-of-memory killer"
    assert exit_cause(-signal.SIGTERM) == "signal SIGTERM" and exit_cause(3) == "exit code 3"


def test_help_and_version_answer_without_importing_torch():
    """``kdacp --help``, ``kdacp <command> --help`` and ``kdacp --version`` build the parser without torch
    (seconds to import); in a fresh interpreter, as the command runs."""
    import subprocess
    import sys
    code = ("import sys\nfrom kdacp.cli import main\n"
            "for argv in (['--help'], ['demo', '--help'], ['bench', '--help'], ['tune', '--help'], ['--version']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
            "print('loaded:', sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "loaded: []", out.stdout[-500:] + out.stderr


@pytest.fixture
def kdacp_logger():
    """The ``kdacp`` logger, its level and handlers restored after the test."""
    import logging
    logger = logging.getLogger("kdacp")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_v_and_q_set_the_kdacp_loggers_level(kdacp_logger, monkeypatch, tmp_path, capsys):
    """Library messages go through the ``kdacp`` logger: warnings by default, progress with -v (before or after
    the command), errors only with -q."""
    import logging

    import kdacp.bench
    from kdacp.cli import main

    def run_suite(name, case, **kwargs):
        logging.getLogger("kdacp.bench.soak").info("progress")
        logging.getLogger("kdacp.bench.soak").warning("a warning")
        return [dict(step=1)]
    monkeypatch.setattr(kdacp.bench, "run_suite", run_suite)
    for argv, shown in ((["bench"], ["a warning"]), (["-v", "bench"], ["progress", "a warning"]),
                        (["bench", "-v"], ["progress", "a warning"]), (["bench", "-q"], [])):
        assert main([*argv, "--suite", "soak", "--out", str(tmp_path)]) == 0
        err = capsys.readouterr().err
        assert [m for m in ("progress", "a warning") if m in err] == shown, (argv, err)


def test_demo_of_one_step_and_its_time_from_the_commands_entry(monkeypatch, capsys):
    """``--steps 1``: no ``nan`` and no "1 steps"; the time breakdown counts from the command's entry, not from
    the process's start (what ran before it in the same process is not the command's)."""
    import re
    import time

    import kdacp.commands
    from kdacp.cli import main

    def launch(fn, world, args, **kwargs):
        row = dict(device="cpu", tokens=64, sequences=1, first_s=0.5, later_ms=None, output_err=0.0, loss_err=0.0,
                   grad_err=0.0, losses=[5.5], precompiled=0, precompile_s=0.0, autotune_s=0.0, strategy="p2p",
                   build_s=0.0, steps_s=0.5, reference_s=0.0, checks_s=0.0, worker_s=0.0, started_at=time.time())
        return [[dict(row, rank=r) for r in range(world)]] * world
    monkeypatch.setattr(kdacp.commands, "launch", launch)
    started = time.time()
    assert main(["demo", "--world-size", "2", "--seq-lens", "64,64", "--steps", "1"]) == 0
    elapsed = time.time() - started
    out = capsys.readouterr().out
    assert "nan" not in out and "1 steps" not in out and ", 1 step\n" in out and "no later steps" in out
    whole = float(re.search(r"time: ([0-9.]+) s from command to verdict", out).group(1))
    assert whole <= elapsed + 0.05, out


def test_bench_progress_has_a_total(monkeypatch, tmp_path, capsys):
    import kdacp.bench
    from kdacp.cli import main

    def run_suite(name, case, *, on_row, **kwargs):
        on_row(dict(t=case["t_local"]))
        return [dict(t=case["t_local"])]
    monkeypatch.setattr(kdacp.bench, "run_suite", run_suite)
    assert main(["bench", "--suite", "layer", "--device", "cpu", "--seq-lens", "64,128", "--out", str(tmp_path)]) == 0
    assert "2/2" in capsys.readouterr().err
