"""Command line: kdacp demo (a checked context-parallel training run), kdacp bench (benchmark suites) and
kdacp tune (FLA's kernel configurations for this GPU)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch

from .backends import BACKENDS, needs_cuda, resolve_backend
from .backends.fla_configs import USER_CONFIGS
from .bench import CPU_SUITES, SUITES
from .bench.batches import BATCHES
from .bench.virtual import CHUNK as VIRTUAL_CHUNK
from .demo import DTYPES, rank_count
from .layers.context_parallel import hybrid_ulysses_size
from .distributed.layout import LAYOUTS
from .distributed.plan import STRATEGY_CHOICES
from .kernels.precision import SummaryPrecision
from .layers.context_parallel import MODES
from .workers import Stopped, WorkerError, check_launch, launch, pick_backend, under_torchrun

_IMPORTED = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (Linux: its start time in ``/proc``, so the interpreter's start-up
    and every import count); elsewhere since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class UsageError(ValueError):
    """A command line that cannot run as given (a bad value, or one this machine cannot hold): ``main`` prints
    it on one line and exits with status 2, before any worker starts."""


def _machine_check(check: Callable, *args) -> None:
    """``check(*args)`` (:func:`kdacp.workers.check_launch`, :func:`~kdacp.workers.pick_backend`), its
    :class:`~kdacp.workers.WorkerError` (what this machine cannot run) a :class:`UsageError`."""
    try:
        check(*args)
    except WorkerError as e:
        raise UsageError(str(e)) from None


def _failed(command: str, error: WorkerError) -> int:
    """Print a run's end on one line (for a failed worker, with its traceback) and return the exit status:
    128 + the signal for a run stopped by one, as a shell reports it, else 1."""
    print(f"kdacp {command}: {error}", file=sys.stderr)
    return 128 + error.signum if isinstance(error, Stopped) else 1


def _number(parse, fits, expected: str):
    """An argparse type: ``parse(text)`` when it ``fits``, else a usage error saying what was ``expected``."""
    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not fits(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return check


_positive_int = _number(int, lambda x: x >= 1, "a positive integer")
_seconds = _number(float, lambda x: 0 < x < float("inf"), "a positive number of seconds")
_positive_float = _number(float, lambda x: 0 < x < float("inf"), "a positive number")
_port = _number(int, lambda x: 0 <= x <= 65535, "a port number from 0 (pick a free one) to 65535")


def _batches(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated batch names of :data:`kdacp.bench.batches.BATCHES`."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in BATCHES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated names from {', '.join(BATCHES)}, got {text!r}")
    return names


# ``kdacp tune --gates``: the KDA gate's name -> the layer's ``gate_lower_bound``
TUNE_GATES = {"safe": -5.0, "softplus": None}


def _gates(text: str) -> tuple[float | None, ...]:
    """argparse type: comma-separated gate names of :data:`TUNE_GATES`, as ``gate_lower_bound`` values."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names or any(n not in TUNE_GATES for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated gates from {', '.join(TUNE_GATES)}, got {text!r}")
    return tuple(TUNE_GATES[n] for n in names)


def _int_list(text: str, low: int, what: str) -> tuple[int, ...]:
    """Comma-separated integers, each at least ``low``; else an argparse error naming ``what`` was expected."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return values


def _lengths(text: str) -> tuple[int, ...]:
    return _int_list(text, 1, "comma-separated positive integers such as 600,250,900,298")


def _modes(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated context-parallel modes of :data:`kdacp.layers.context_parallel.MODES`."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names or any(n not in MODES for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated modes from {', '.join(MODES)}, got {text!r}")
    return names


def _layouts(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated token layouts of :data:`kdacp.distributed.layout.LAYOUTS`."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names or any(n not in LAYOUTS for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated layouts from {', '.join(LAYOUTS)}, got {text!r}")
    return names


def _rank_counts(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated numbers of ranks, each at least 2."""
    values = _lengths(text)
    if min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected comma-separated rank counts of at least 2, got {text!r}")
    return values


def _sync_intervals(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated numbers of mixer layers between attention layers, each >= 0."""
    return _int_list(text, 0, "comma-separated integers >= 0 such as 0,3")


# The scaling and hybrid suites' link options: flag -> (the Link field it sets, the factor from the flag's unit to
# the field's, its help).
_LINK_OPTIONS = {
    "--link-latency-us": ("latency_s", 1e-6, "point-to-point latency in microseconds (replaces the measured or "
                                             "default figure; default without a second rank: 20)"),
    "--link-bandwidth-gbs": ("bandwidth", 1e9, "point-to-point bandwidth in GB/s (default without a second rank: 300)"),
    "--gather-latency-us": ("gather_latency_s", 1e-6, "all-gather latency per ring step in microseconds (default: 20)"),
    "--gather-bandwidth-gbs": ("gather_bandwidth", 1e9, "all-gather bandwidth per ring step in GB/s (default: 300)"),
}


def _link_figures(args: argparse.Namespace) -> dict:
    """The link figures given on the command line (:data:`_LINK_OPTIONS`), converted to seconds and bytes/s."""
    given = {field: (getattr(args, flag[2:].replace("-", "_")), scale)
             for flag, (field, scale, _) in _LINK_OPTIONS.items()}
    return {field: value * scale for field, (value, scale) in given.items() if value is not None}


def _hybrid_case(args: argparse.Namespace) -> dict:
    """The hybrid suite's options from the command line."""
    case = dict(calibration=args.calibration, attention_tflops=args.attention_tflops, balance=args.balance,
                link=_link_figures(args) or None,
                heads=args.heads, head_dim=args.head_dim, backend=args.backend)
    if args.seq_lens:
        case["tokens"] = tuple(args.seq_lens)
    if args.predict_ranks:
        case["world_sizes"] = tuple(args.predict_ranks)
    return case


def _scaling_case(args: argparse.Namespace) -> dict:
    """The scaling suite's options from the command line (link figures converted to seconds and bytes/s)."""
    link = _link_figures(args)
    case = dict(t_local=args.seq_lens[0] if args.seq_lens else None, heads=args.heads, head_dim=args.head_dim,
                backend=args.backend, link=link or None, measured=args.measured, sleep_check=args.sleep_check)
    if args.predict_ranks:
        case["world_sizes"] = args.predict_ranks
    if args.step_layers is not None:
        case["step_layers"] = args.step_layers
    if args.sync_every is not None:
        case["sync_every"] = args.sync_every
    return case


def _print_demo_table(rows: list[dict], tol: float, strategy: str) -> bool:
    """The per-rank table, the step times, the state exchange ``--strategy auto`` chose and the verdict;
    True when every error is within ``tol``."""
    print(f"{'rank':>4} {'device':>8} {'tokens':>7} {'sequences':>9} {'first s':>8} {'later ms':>9} "
          f"{'output err':>11} {'loss err':>9} {'grad err':>9}")
    for r in rows:
        print(f"{r['rank']:>4} {r['device']:>8} {r['tokens']:>7} {r['sequences']:>9} {r['first_s']:>8.2f} "
              f"{r['later_ms']:>9.1f} {r['output_err']:>11.2e} {r['loss_err']:>9.2e} {r['grad_err']:>9.2e}")
    slowest = max(rows, key=lambda r: r["first_s"])
    later = max(r["later_ms"] for r in rows)
    first = (f"first step {slowest['first_s']:.2f} s (of it {slowest['precompile_s']:.2f} s compiling its "
             f"{slowest['precompiled']} new Triton kernels in parallel ahead of it, kdacp.precompile, and "
             f"{slowest['autotune_s']:.2f} s of autotuning)" if slowest["precompiled"] or slowest["autotune_s"]
             else f"first step {slowest['first_s']:.2f} s")
    print(f"step time (slowest rank): {first}, "
          + (f"later steps {later:.1f} ms on average" if len(rows[0]["losses"]) > 1 else "no later steps"))
    if strategy == "auto":
        chosen = rows[0]["strategy"]
        print("--strategy auto: " + ("no state is passed in this mode" if chosen == "none" else f"chose {chosen}"))
    print("loss per step: " + ", ".join(f"{x:.4f}" for x in rows[0]["losses"]))
    worst = max(max(r["output_err"], r["loss_err"], r["grad_err"]) for r in rows)
    ok = worst <= tol
    if ok:
        print(f"PASS: context-parallel logits, loss and gradients match the one-process model "
              f"(largest relative error {worst:.2e}, tolerance {tol:.0e})")
    else:
        print(f"FAIL: largest relative error {worst:.2e} exceeds the tolerance {tol:.0e}")
    return ok


def _print_demo_time(row: dict, launched_at: float, world: int) -> None:
    """Where the whole command's wall time went, from the process's start to the verdict: before the
    launch (``launched_at``, ``time.time()``), the workers' start until rank 0's function began, rank 0's
    phases (:data:`kdacp.demo.PHASES`), then gathering the results and the workers' exit."""
    now, whole = time.time(), process_age_s()
    start = row["started_at"] - launched_at
    what = "in this process: model imports, process group" if world == 1 else "processes, imports, process group"
    parts = [f"{whole - (now - launched_at):.1f} s interpreter, imports and set-up",
             f"{start:.1f} s starting {rank_count(world)} ({what})",
             f"{row['build_s']:.1f} s building the model",
             f"{row['steps_s']:.1f} s context-parallel steps (of it {row['precompile_s']:.1f} s compiling ahead, "
             f"{row['autotune_s']:.1f} s autotuning)", f"{row['reference_s']:.1f} s the one-process reference",
             f"{row['checks_s']:.1f} s checks, exchanges and optimizer steps",
             f"{now - launched_at - start - row['worker_s']:.1f} s results"
             + (" and the workers' exit" if world > 1 else " and the process group's end")]
    print(f"time: {whole:.1f} s from command to verdict: " + ", ".join(parts) + " (rank 0)")


def _demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .demo import demo_config, demo_worker
    from .models import load_kimi_linear

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _machine_check(pick_backend, device, 1)  # a GPU, before the world size counts them
    world = args.world_size if args.world_size is not None else (torch.cuda.device_count() if device == "cuda" else 4)
    if under_torchrun():
        if args.world_size not in (None, int(os.environ["WORLD_SIZE"])):
            raise UsageError(f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE="
                             f"{os.environ['WORLD_SIZE']}; leave it out under torchrun")
        world = int(os.environ["WORLD_SIZE"])
    cfg = demo_config(world, args.mode, ulysses_size=args.ulysses_size, num_heads=args.heads, head_dim=args.head_dim,
                      seq_lens=args.seq_lens, strategy=args.strategy, backend=args.backend, device=device,
                      dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"), steps=args.steps,
                      seed=args.seed, precompile=args.precompile)
    try:
        cfg.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    _machine_check(check_launch, world, device, args.port)
    show = not under_torchrun() or int(os.environ["RANK"]) == 0
    if show:
        print(f"demo: {cfg.describe()}", flush=True)
    bar = tqdm(total=cfg.steps, desc=f"demo: {rank_count(world)}, {cfg.mode}", disable=not show, file=sys.stderr)

    def on_report(rank, message):
        if rank == 0 and message[0] == "step":
            bar.n = message[1]
            bar.refresh()

    timeout = args.timeout if args.timeout is not None else (1800.0 if device == "cuda" else 300.0)
    if device == "cuda" and show:
        # Without tuned configurations FLA autotunes each new shape in the first step: minutes on a GPU.
        print("kdacp demo: on a GPU the first step includes compiling the Triton kernels and FLA's autotuning "
              "of any kernel shape without a tuned configuration (kdacp ships the H200's, which other "
              "Hopper GPUs take when they have none of their own); the whole command's time and what it "
              "went to are printed at the end", file=sys.stderr)
    launched_at = time.time()
    try:
        results = launch(demo_worker, world, (cfg,), device=device, port=args.port, timeout_s=timeout,
                         on_report=on_report, prepare=load_kimi_linear)
    except WorkerError as e:
        bar.close()
        return _failed("demo", e)
    bar.close()
    if not show:
        return 0
    rows = results[0]
    ok = _print_demo_table(rows, cfg.tolerance, cfg.strategy)
    _print_demo_time(rows[0], launched_at, world)
    return 0 if ok else 1


# The layer suite's defaults are sized for GPUs (16K tokens per rank, 2048 wide, 32 heads) and
# run for many minutes on CPU; these finish in seconds there.
_CPU_LAYER = dict(backend="torch", hidden=128, heads=4, head_dim=32, warmup=1, iters=3)
_CPU_T_LOCAL = 256

# The bench options that only some suites read: given to another suite, they are a usage error
# rather than silently unused.
_SUITE_OPTIONS = {"seq_lens": ("kernels", "cp", "gdn", "layer", "scaling", "overhead", "virtual", "hybrid", "balance"),
                  "batches": ("cp", "layer", "gdn", "overhead"),
                  "trace": ("cp",), "world_size": ("cp", "layer", "soak", "scaling", "gdn"),
                  "backend": ("layer", "scaling", "overhead", "hybrid"), "hidden": ("layer",),
                  "heads": ("layer", "scaling", "overhead", "virtual", "hybrid", "balance"),
                  "head_dim": ("layer", "scaling", "overhead", "virtual", "hybrid", "balance"),
                  "ranks": ("virtual", "overhead"), "layouts": ("overhead",),
                  "family": ("kernels", "cp", "overhead", "layer"), "modes": ("layer",), "steps": ("soak",),
                  "step_layers": ("scaling",), "sync_every": ("scaling",), "summary_precision": ("overhead",),
                  "calibration": ("hybrid",), "attention_tflops": ("hybrid",), "balance": ("hybrid",),
                  "predict_ranks": ("scaling", "hybrid", "balance"), "rounds": ("overhead", "layer"),
                  "iters": ("overhead", "layer")}


def _unread_option(args: argparse.Namespace) -> str | None:
    """The message for the first bench option given that ``--suite`` does not read, or ``None``."""
    for name, suites in _SUITE_OPTIONS.items():
        if getattr(args, name) is not None and args.suite not in suites:
            flag = "--" + name.replace("_", "-")
            return f"{flag} is for --suite {' or '.join(suites)}, not --suite {args.suite}"
    return None


def _missing_gpu(suite: str, device: str) -> str | None:
    """Why ``suite`` cannot run on ``device`` here (no CUDA GPU visible), or ``None``."""
    if torch.cuda.is_available():
        return None
    if suite not in CPU_SUITES:
        return (f"--suite {suite} needs a CUDA GPU and none is visible: it compares with FLA's CUDA kernels "
                f"(--suite {', '.join(CPU_SUITES)} also run on CPU)")
    if device == "cuda":
        return f"--device cuda was asked for but no CUDA GPU is visible; --suite {suite} also runs with --device cpu"
    return None


def _bench_cases(args: argparse.Namespace, device: str) -> list[dict]:
    """The suite's option dicts, one per run (several ``--seq-lens`` of kernels and layer run one by one)."""
    seq_lens = args.seq_lens
    if args.suite == "kernels":
        cases = [{"T": T, "family": args.family or "kda"} for T in (seq_lens or [16384])]
    elif args.suite == "virtual":
        given = dict(world_sizes=args.ranks, tokens_per_rank=seq_lens[0] if seq_lens else None, HV=args.heads,
                     K=args.head_dim, V=args.head_dim)
        cases = [{name: value for name, value in given.items() if value is not None}]
    elif args.suite == "soak":
        cases = [{} if args.steps is None else {"steps": args.steps}]
    elif args.suite == "scaling":
        cases = [_scaling_case(args)]
    elif args.suite == "hybrid":
        cases = [_hybrid_case(args)]
    elif args.suite == "balance":
        cases = [dict(tokens=seq_lens[0] if seq_lens else None, heads=args.heads, head_dim=args.head_dim,
                      **({"world_sizes": args.predict_ranks} if args.predict_ranks else {}))]
    elif args.suite == "overhead":
        cases = [dict(t_local=seq_lens[0] if seq_lens else None, heads=args.heads, head_dim=args.head_dim,
                      backend=args.backend, families=(args.family,) if args.family else ("kda", "gdn"),
                      summary_precision=args.summary_precision, rounds=args.rounds, iters=args.iters)]
        cases[0].update({name: value for name, value in (("layouts", args.layouts), ("world_sizes", args.ranks))
                         if value is not None})
    elif args.suite == "gdn":
        cases = [{"t_locals": tuple(seq_lens or (16384, 32768))}]
    elif args.suite == "cp":
        cases = [{"t_locals": tuple(seq_lens or (16384, 32768)), "family": args.family or "kda"}]
        if args.trace:
            cases[0]["trace_dir"] = args.trace
    else:
        layer = {} if device == "cuda" else dict(_CPU_LAYER)
        given = dict(backend=args.backend, hidden=args.hidden, heads=args.heads, head_dim=args.head_dim,
                     modes=args.modes, family=args.family, rounds=args.rounds, iters=args.iters)
        layer.update({name: value for name, value in given.items() if value is not None})
        cases = [{"t_local": T, **layer} for T in (seq_lens or [16384 if device == "cuda" else _CPU_T_LOCAL])]
    if args.batches:
        for case in cases:
            case["batches"] = args.batches
    return cases


def _layer_modes_error(args: argparse.Namespace, world: int, device: str) -> str | None:
    """Why the layer suite's ``--modes`` cannot run on ``world`` ranks, or ``None``."""
    heads = args.heads or (32 if device == "cuda" else _CPU_LAYER["heads"])
    for mode in args.modes or ():
        if mode == "hybrid" and hybrid_ulysses_size(world) is None:
            return (f"--modes hybrid runs Ulysses in groups and state passing across them, so the world size needs "
                    f"a divisor between 1 and itself; {world} has none (4 or 6 do)")
        if mode != "state" and heads % (world if mode == "ulysses" else hybrid_ulysses_size(world)):
            return f"--modes {mode} splits the {heads} heads over the ranks of a Ulysses group; {heads} do not split"
    return None


def _check_backend(backend: str, device: str) -> None:
    """:class:`UsageError` unless ``--backend`` (``fla`` or ``attn_gym``) can run on ``device`` here (CUDA, its
    packages installed, attn_gym: a Hopper GPU)."""
    if device != "cuda":
        raise UsageError(f"--backend {backend} needs --device cuda (its kernels are CUDA-only), got --device {device}; "
                         "use --backend torch")
    try:
        resolve_backend(backend, torch.device(device))
    except (ImportError, ValueError) as e:
        raise UsageError(f"--backend {backend}: {e}") from None


def _bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .bench import load_suite, run_suite
    from .bench.harness import markdown_table, write_results

    unread = _unread_option(args)
    if unread:
        raise UsageError(unread)
    if args.family == "conv" and args.suite != "kernels":
        raise UsageError(f"--family conv is for --suite kernels, not --suite {args.suite}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    missing = _missing_gpu(args.suite, device)
    if missing:
        raise UsageError(missing)
    if needs_cuda(args.backend):
        _check_backend(args.backend, device)
    if args.suite == "overhead" and args.ranks and set(args.layouts or ("contiguous",)) == {"contiguous"}:
        raise UsageError("--ranks is for the overhead suite's layouts other than contiguous (the contiguous roles are "
                         "a 3-rank plan's): add --layouts zigzag or document_zigzag")
    if args.suite in ("scaling", "overhead", "virtual", "balance") and args.seq_lens and len(args.seq_lens) > 1:
        what = "the sequence" if args.suite == "balance" else "tokens per rank"
        raise UsageError(f"--suite {args.suite} takes one --seq-lens value ({what}), got {len(args.seq_lens)}")
    if args.suite == "virtual" and args.seq_lens and args.seq_lens[0] % VIRTUAL_CHUNK:
        raise UsageError(f"--suite virtual takes tokens per rank in multiples of the chunk size {VIRTUAL_CHUNK}, got "
                         f"--seq-lens {args.seq_lens[0]}")
    for flag, path in (("--measured", args.measured), ("--calibration", args.calibration), ("--balance", args.balance)):
        if path is not None and not os.path.isfile(path):
            raise UsageError(f"{flag} {path}: no such file")
    if args.attention_tflops is not None and args.balance is not None:
        raise UsageError("give --attention-tflops or --balance, not both")
    suite = load_suite(args.suite)
    world = args.world_size or (1 if args.suite == "gdn" else max(torch.cuda.device_count(), 1) if device == "cuda"
                                else 2)
    modes_error = _layer_modes_error(args, world, device)
    if modes_error:
        raise UsageError(modes_error)
    if args.suite in _SUITE_OPTIONS["world_size"]:
        _machine_check(check_launch, world, device, args.port)
    render = getattr(suite, "markdown", markdown_table)
    plots = getattr(suite, "PLOTS", None)
    measured: list[dict] = []  # every row as it is reported, kept when the run stops early
    bar = tqdm(desc=f"bench {args.suite}", unit="row", file=sys.stderr)

    def on_row(row: dict) -> None:
        measured.append(row)
        write_results(args.suite, measured, args.out, markdown=render, complete=False)
        bar.update()

    rows: list[dict] = []
    try:
        for case in _bench_cases(args, device):
            rows += run_suite(args.suite, case, device=device, world_size=world, port=args.port,
                              timeout_s=args.timeout, on_row=on_row)
    except Exception as e:  # noqa: BLE001 - a failed suite ends the command with its reason
        bar.close()
        if measured:
            paths = write_results(args.suite, measured, args.out, plots, markdown=render, complete=False)
            print(render(measured))
            print(f"kept the {len(measured)} rows measured before the run stopped: " + ", ".join(map(str, paths)))
        if isinstance(e, WorkerError):
            return _failed("bench", e)
        print(f"kdacp bench: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    bar.close()
    paths = write_results(args.suite, rows, args.out, plots, markdown=render)
    print(render(rows))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _tune(args: argparse.Namespace) -> int:
    from .tuning import tune
    try:
        paths = tune(args.out, t_local=tuple(args.seq_lens), hidden=args.hidden, heads=args.heads,
                     head_dim=args.head_dim, batches=args.batches, gates=args.gates)
    except RuntimeError as e:
        print(f"kdacp tune: {e}", file=sys.stderr)
        return 1
    folder = paths[0].parent if paths else args.out
    use = ("kdacp uses them on this GPU from now on" if args.out is None
           else f"FLA uses them where FLA_CONFIG_DIR={folder} and FLA_CACHE_MODE=strict are set")
    print(f"wrote {len(paths)} FLA configuration files into {folder}; {use}")
    return 0


# What each choice of an option means, in its help text (:func:`_add_choice`).
_MODE_MEANINGS = {"state": "time shards, state passed between ranks", "ulysses": "all-to-all to head shards",
                  "hybrid": "Ulysses in groups, state across them"}
_STRATEGY_MEANINGS = {"p2p": "hop by hop along the ranks", "allgather": "every rank gathers every summary",
                      "scan": "recursive doubling, log2 P rounds",
                      "auto": "the cost model's pick for the plan, printed at the end"}
_BACKEND_MEANINGS = {"auto": "attn_gym on a Hopper GPU where installed, else fla on CUDA when installed, else torch "
                             "(the first line says which)",
                     "torch": "PyTorch's, on any device", "fla": "FLA's Triton kernels, CUDA only",
                     "attn_gym": "attention-gym's KDA/GDN cores for training beside FLA's kernels, Hopper only"}
_FAMILY_MEANINGS = {"kda": "Kimi Linear's per-channel gate and shapes", "gdn": "the scalar gate at Qwen3-Next shapes",
                    "conv": "kernels suite only: the short convolution against FLA's"}


def _add_choice(parser: argparse.ArgumentParser, flag: str, choices, meanings: dict, default, what: str = "", *,
                default_text: str = "%(default)s") -> None:
    """An option taking one of ``choices``, its help ``what`` and then each choice's meaning (``meanings``; a
    choice without one is a ``KeyError`` here) and the default (``default_text``: where it depends on more)."""
    parts = ([what] if what else []) + [f"{name}: {meanings[name]}" for name in choices]
    parser.add_argument(flag, default=default, choices=choices, help="; ".join(parts) + f" (default: {default_text})")


def _add_launch_options(parser: argparse.ArgumentParser, *, world_size: str, timeout: str,
                        timeout_default: float | None = None) -> None:
    """The options of a command that starts ranks: ``--world-size`` and ``--timeout`` with the command's help
    texts (``timeout_default``: seconds, or None where the command picks by device), ``--device``, ``--port``."""
    parser.add_argument("--world-size", type=_positive_int, default=None, help=world_size)
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="where the ranks run: gloo on CPU, NCCL with one GPU per rank on CUDA (default: cuda "
                             "when available)")
    parser.add_argument("--port", type=_port, default=0,
                        help="rendezvous port; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--timeout", type=_seconds, default=timeout_default, help=timeout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdacp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny Kimi Linear model context-parallel and check it against one "
                                       "process",
                          description="Train a tiny Hugging Face Kimi Linear model (KDA and MLA layers) under "
                                      "kdacp.parallelize for a few steps and check its logits, loss and gradients "
                                      "against the unmodified model in one process; prints the first step's time "
                                      "and the later steps' mean.")
    _add_launch_options(demo, world_size="ranks to start (default: 4 on CPU, every GPU on CUDA)",
                        timeout="seconds from starting the workers before the run is stopped (default: 300 on CPU; "
                                "1800 on CUDA, where FLA autotunes kernel shapes without a tuned configuration at "
                                "first use)")
    demo.add_argument("--seq-lens", type=_lengths, default=(600, 250, 900, 298),
                      help="comma-separated lengths of the packed batch; their sum must split equally over the "
                           "ranks (default: 600,250,900,298)")
    _add_choice(demo, "--mode", MODES, _MODE_MEANINGS, "state")
    demo.add_argument("--ulysses-size", type=_positive_int, default=None,
                      help="--mode hybrid: ranks per Ulysses group, a divisor of the world size strictly between 1 "
                           "and it (default: the smallest such divisor)")
    demo.add_argument("--heads", type=_positive_int, default=None,
                      help="heads of every KDA and MLA layer, a multiple of the world size (the MLA layers' "
                           "Ulysses attention splits them over all ranks) (default: 4 on CPU, 32 on CUDA, or the "
                           "world size's smallest multiple from there up)")
    demo.add_argument("--head-dim", type=_positive_int, default=None,
                      help="size of each head, even (default: 16 on CPU; 128 on CUDA, Kimi Linear's, at which the "
                           "shipped H200 kernel configurations were tuned)")
    _add_choice(demo, "--strategy", STRATEGY_CHOICES, _STRATEGY_MEANINGS, "p2p", "how state passing exchanges states")
    _add_choice(demo, "--backend", BACKENDS, _BACKEND_MEANINGS, "auto", "kdacp's KDA kernels")
    demo.add_argument("--dtype", default=None, choices=DTYPES,
                      help="of the context-parallel model; the reference runs in float32 (no float64: "
                           "transformers' Kimi Linear computes in float32 inside) (default: float32 on CPU, "
                           "bfloat16 on CUDA)")
    demo.add_argument("--steps", type=_positive_int, default=3, help="training steps (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights and batches (default: %(default)s)")
    demo.add_argument("--no-precompile", dest="precompile", action="store_false",
                      help="on a GPU, let the first step compile each Triton kernel as it first launches instead "
                           "of compiling them all in parallel ahead of it (kdacp.precompile)")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="run a benchmark suite; writes JSON, Markdown and PNG plots",
                           description="Run one benchmark suite and write <suite>.json, <suite>.md and its PNG "
                                       f"plots. Without a GPU: --suite {', '.join(CPU_SUITES)} (layer with "
                                       "--backend torch); the others compare with FLA's CUDA kernels. Rows are "
                                       "written as they are measured: a run stopped early (--timeout, a signal) "
                                       "keeps them.")
    bench.add_argument("--suite", required=True, choices=SUITES,
                       help=f"what to run; on CPU: {', '.join(CPU_SUITES)}")
    bench.add_argument("--seq-lens", type=_lengths, default=None,
                       help="comma-separated tokens (per rank for cp/layer/gdn/scaling/virtual; the whole sequence "
                            "for hybrid and balance) (default: kernels 16384; hybrid 131072,524288,1048576; balance "
                            f"131072; cp and gdn 16384,32768; layer 16384, on CPU {_CPU_T_LOCAL}; virtual "
                            f"{VIRTUAL_CHUNK}, a multiple of {VIRTUAL_CHUNK})")
    bench.add_argument("--batches", type=_batches, default=None,
                       help=f"cp/layer/gdn/overhead: comma-separated global batches from {', '.join(BATCHES)} (default: "
                            "all; gdn: one_sequence,docs7)")
    bench.add_argument("--trace", default=None, metavar="DIR",
                       help="cp: also write a Chrome trace per rank and contender into DIR and add a per-rank "
                            "compute/wait/idle breakdown of one step to the rows")
    _add_choice(bench, "--family", ("kda", "gdn", "conv"), _FAMILY_MEANINGS, None,
                "kernels, cp, overhead and layer suites", default_text="kda; overhead: both")
    bench.add_argument("--summary-precision", default=None, choices=[p.value for p in SummaryPrecision],
                       help="overhead suite: the summary kernels' precision policy (default: the dtype's; the "
                            "kernels suite times every policy)")
    bench.add_argument("--out", default="results",
                       help="folder for the JSON, Markdown and PNG files (default: %(default)s)")
    _add_launch_options(bench,
                        world_size="ranks for cp, layer, soak and scaling (default: every GPU; 2 on CPU; gdn: 1)",
                        timeout="seconds from the suite's start (a multi-rank suite's: its workers') before it is "
                                "stopped; the rows measured by then are kept (default: %(default)s)",
                        timeout_default=1800.0)
    bench.add_argument("--modes", type=_modes, default=None,
                       help="layer suite: comma-separated context-parallel modes to time, from "
                            f"{', '.join(MODES)} (hybrid: Ulysses groups of the world size's smallest divisor) "
                            "(default: state)")
    bench.add_argument("--rounds", type=_positive_int, default=None,
                       help="overhead and layer suites: timing rounds, each contender's calls in turn (default: 10 "
                            "overhead, 3 layer on CUDA)")
    bench.add_argument("--iters", type=_positive_int, default=None,
                       help="overhead and layer suites: calls back to back in a round (default 5)")
    bench.add_argument("--steps", type=_positive_int, default=None,
                       help="soak suite: training steps, a row at the first, every twentieth of them and the last "
                            "(default: 2000)")
    _add_choice(bench, "--backend", ("torch", "fla", "attn_gym"), _BACKEND_MEANINGS, None,
                "layer and scaling suites: KDA backend",
                default_text="fla on CUDA, torch on CPU")
    bench.add_argument("--hidden", type=_positive_int, default=None,
                       help=f"layer suite: hidden size (default 2048; {_CPU_LAYER['hidden']} on CPU)")
    bench.add_argument("--heads", type=_positive_int, default=None,
                       help=f"layer suite: heads (default 32; {_CPU_LAYER['heads']} on CPU); scaling: H = HV "
                            "(default 32; 2 on CPU); virtual: HV (default 2)")
    bench.add_argument("--head-dim", type=_positive_int, default=None,
                       help=f"layer suite: head dim (default 128; {_CPU_LAYER['head_dim']} on CPU); scaling: K = V "
                            "(default 128; 32 on CPU); virtual: K = V (default 16)")
    for flag, (_, _, text) in _LINK_OPTIONS.items():
        bench.add_argument(flag, type=_positive_float, default=None, help=f"scaling suite: {text}")
    for flag, kind, text in (
            ("--ranks", _rank_counts, "virtual suite: comma-separated numbers of virtual ranks (default: 2,4,8,16,64 "
                                      "on CPU; up to 1024 on CUDA); overhead: the P of each layout other than "
                                      "contiguous whose rank roles are timed (default: 2,8,64)"),
            ("--layouts", _layouts, "overhead suite: comma-separated token layouts from "
                                    f"{', '.join(LAYOUTS)} whose rank roles are timed (default: contiguous)"),
            ("--predict-ranks", _rank_counts, "scaling suite: comma-separated rank counts to predict (default: "
                                              "2,4,...,1024); hybrid and balance: the rank counts (default: 8,16,64)"),
            ("--step-layers", _positive_int, "scaling suite: token-mixer layers of the step model's training step "
                                             "(default: 36, Qwen3-Next-80B's Gated DeltaNet layers)"),
            ("--sync-every", _sync_intervals, "scaling suite: comma-separated mixer layers between attention layers, "
                                              "a step model row each; 0: none (default: 0,3)")):
        bench.add_argument(flag, type=kind, default=None, help=text)
    bench.add_argument("--sleep-check", action="store_true",
                       help="scaling suite, two or more CPU ranks: also check the model's composition with ranks "
                            "whose stages sleep (no compute, so no contention for cores)")
    bench.add_argument("--calibration", default=None, metavar="JSON",
                       help="hybrid suite: a scaling suite's JSON whose stage and link figures are used instead of "
                            "measuring here")
    bench.add_argument("--attention-tflops", type=_positive_float, default=None,
                       help="hybrid suite: achieved causal-attention throughput in TFLOP/s (the balance suite's "
                            "step_tflops; default 400)")
    bench.add_argument("--balance", default=None, metavar="JSON",
                       help="hybrid suite: a balance suite's JSON whose measured attention throughput is used")
    bench.add_argument("--measured", default=None, metavar="JSON",
                       help="scaling suite: a cp suite's JSON whose rows are drawn as measured points")
    bench.set_defaults(func=_bench)

    tune = sub.add_parser("tune", help="autotune FLA's kernels for kdacp's layer on this GPU and save the "
                                       "configurations, which kdacp then prefers over the shipped ones",
                          description="Autotune FLA's kernels for kdacp's KimiDeltaAttention layer at the given "
                                      "sizes on this GPU and save the configurations. By default they go to "
                                      f"{USER_CONFIGS}/<GPU name>, where kdacp looks first: it then uses them "
                                      "instead of the ones it ships (tuned on the H200, and taken "
                                      "by other GPUs of its architecture), so a first run on this GPU no "
                                      "longer autotunes these shapes; the shapes it does not tune keep the "
                                      "configurations used before. Running it again adds to the files there. "
                                      "Needs a CUDA GPU and a fresh process.")
    tune.add_argument("--out", default=None,
                      help=f"folder for the files (default: {USER_CONFIGS}/<GPU name>, which kdacp reads; kdacp "
                           "reads another folder only where FLA_CONFIG_DIR names it)")
    tune.add_argument("--seq-lens", type=_lengths, default=(16384, 2048),
                      help="comma-separated tokens per call; some kernels tune per token count (default: 16384,2048)")
    tune.add_argument("--hidden", type=_positive_int, default=2048,
                      help="the layer's hidden size (default: %(default)s)")
    tune.add_argument("--heads", type=_positive_int, default=32, help="the layer's heads (default: %(default)s)")
    tune.add_argument("--head-dim", type=_positive_int, default=128,
                      help="the size of each head, K = V (default: %(default)s)")
    tune.add_argument("--batches", type=_batches, default=("one_sequence", "docs7"),
                      help=f"comma-separated batches from {', '.join(BATCHES)}: one sequence and several documents "
                           "run different kernels (default: one_sequence,docs7)")
    tune.add_argument("--gates", type=_gates, default=(-5.0, None),
                      help="comma-separated KDA gates, which run different kernels: safe, Kimi Linear's with lower "
                           "bound -5, and softplus, transformers' Kimi Linear's, which kdacp demo runs (default: "
                           "safe,softplus)")
    tune.set_defaults(func=_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status: 0 success, 2 a usage error (argparse's, or :class:`UsageError`:
    one line, before any worker starts), 1 a run that failed, 128 + N a run stopped by signal N."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"kdacp {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before or after a launch (during one, the launcher stops its workers)
        print(f"kdacp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
