"""The ``kdacp`` commands (demo, bench, tune) over the parsed command line (:mod:`kdacp.options`); the
command line's entry is :mod:`kdacp.cli`."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .backends import needs_cuda, resolve_backend
from .bench.layer import memory_bytes as layer_memory_bytes
from .choices import CPU_SUITES, VIRTUAL_CHUNK
from .demo import plural
from .cp.context import hybrid_ulysses_size
from .options import CPU_LAYER, CPU_T_LOCAL, LINK_OPTIONS
from .workers import Stopped, WorkerError, check_launch, check_memory, launch, pick_backend, under_torchrun


class UsageError(ValueError):
    """A command line that cannot run as given (a bad value, or one this machine cannot hold): :func:`run`
    prints it on one line and returns exit status 2, before any worker starts."""


def _machine_check(check: Callable, *args) -> None:
    """``check(*args)`` (:func:`kdacp.workers.check_launch`, :func:`~kdacp.workers.check_memory`,
    :func:`~kdacp.workers.pick_backend`), its
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


def _link_figures(args: argparse.Namespace) -> dict:
    """The link figures given on the command line (:data:`LINK_OPTIONS`), converted to seconds and bytes/s."""
    given = {field: (getattr(args, flag[2:].replace("-", "_")), scale)
             for flag, (field, scale, _) in LINK_OPTIONS.items()}
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
        later_ms = "-" if r["later_ms"] is None else f"{r['later_ms']:.1f}"
        print(f"{r['rank']:>4} {r['device']:>8} {r['tokens']:>7} {r['sequences']:>9} {r['first_s']:>8.2f} "
              f"{later_ms:>9} {r['output_err']:>11.2e} {r['loss_err']:>9.2e} {r['grad_err']:>9.2e}")
    slowest = max(rows, key=lambda r: r["first_s"])
    first = (f"first step {slowest['first_s']:.2f} s (of it {slowest['precompile_s']:.2f} s compiling its "
             f"{slowest['precompiled']} new Triton kernels in parallel ahead of it, kdacp.precompile, and "
             f"{slowest['autotune_s']:.2f} s of autotuning)" if slowest["precompiled"] or slowest["autotune_s"]
             else f"first step {slowest['first_s']:.2f} s")
    print(f"step time (slowest rank): {first}, "
          + ("no later steps" if rows[0]["later_ms"] is None
             else f"later steps {max(r['later_ms'] for r in rows):.1f} ms on average"))
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


def _print_demo_time(row: dict, entered_at: float, launched_at: float, world: int) -> None:
    """Where the command's wall time went, from its entry (``entered_at``, ``time.time()``, before it imports
    torch) to the verdict: before the launch (``launched_at``), the workers' start until rank 0's function
    began, rank 0's phases (:data:`kdacp.demo.PHASES`), then gathering the results and the workers' exit."""
    now = time.time()
    whole, start = now - entered_at, row["started_at"] - launched_at
    what = "in this process: model imports, process group" if world == 1 else "processes, imports, process group"
    parts = [f"{launched_at - entered_at:.1f} s imports and set-up",
             f"{start:.1f} s starting {plural(world, 'rank')} ({what})",
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
    from .integrations.transformers import load_kimi_linear

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
    _machine_check(check_memory, cfg.memory_bytes(), world, device,
                   f"--seq-lens ({sum(cfg.seq_lens)} tokens), --heads {cfg.num_heads}, --head-dim {cfg.head_dim} and "
                   f"--dtype {cfg.dtype}")
    show = not under_torchrun() or int(os.environ["RANK"]) == 0
    if show:
        print(f"demo: {cfg.describe()}", flush=True)
    bar = tqdm(total=cfg.steps, desc=f"demo: {plural(world, 'rank')}, {cfg.mode}", disable=not show, file=sys.stderr)

    def on_report(rank, message):
        if rank == 0 and message[0] == "step":
            bar.n = message[1]
            bar.refresh()

    timeout = args.timeout if args.timeout is not None else (1800.0 if device == "cuda" else 300.0)
    if device == "cuda" and show:
        # Without tuned configurations FLA autotunes each new shape in the first step: minutes on a GPU.
        print("kdacp demo: on a GPU the first step includes compiling the Triton kernels and FLA's autotuning "
              "of any kernel shape without a tuned configuration (kdacp ships the H100 80GB's and the "
              "H200's, which other Hopper GPUs take when they have none of their own); the whole command's time and what it "
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
    _print_demo_time(rows[0], args.entered_at, launched_at, world)
    return 0 if ok else 1


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
        layer = {} if device == "cuda" else dict(CPU_LAYER)
        given = dict(backend=args.backend, hidden=args.hidden, heads=args.heads, head_dim=args.head_dim,
                     modes=args.modes, family=args.family, rounds=args.rounds, iters=args.iters)
        layer.update({name: value for name, value in given.items() if value is not None})
        cases = [{"t_local": T, **layer} for T in (seq_lens or [16384 if device == "cuda" else CPU_T_LOCAL])]
    if args.batches:
        for case in cases:
            case["batches"] = args.batches
    return cases


def _layer_modes_error(args: argparse.Namespace, world: int, device: str) -> str | None:
    """Why the layer suite's ``--modes`` cannot run on ``world`` ranks, or ``None``."""
    heads = args.heads or (32 if device == "cuda" else CPU_LAYER["heads"])
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


def _check_folder(flag: str, path: str) -> None:
    """:class:`UsageError` unless ``path`` can be the folder ``flag`` names: it, or the nearest of the folders
    above it that exists, is a folder (the missing ones are made)."""
    for above in (Path(path), *Path(path).parents):
        if above.exists():
            if not above.is_dir():
                raise UsageError(f"{flag} {path}: expected a folder (made where missing), but {above} is a file")
            return


# The layer suite's sizes (its ``run``'s arguments) and the options that set them, for its memory check.
_LAYER_SIZES = {"t_local": "--seq-lens", "hidden": "--hidden", "heads": "--heads", "head_dim": "--head-dim"}


def _bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .bench import load_suite, run_suite
    from .bench.harness import markdown_table, write_results

    unread = _unread_option(args)
    if unread:
        raise UsageError(unread)
    _check_folder("--out", args.out)
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
    cases = _bench_cases(args, device)
    if args.suite == "layer":
        for case in cases:
            _machine_check(check_memory, layer_memory_bytes(world, **case), world, device, "the layer suite's " + ", ".join(
                f"{flag} {case[name]}" for name, flag in _LAYER_SIZES.items() if name in case))
    render = getattr(suite, "markdown", markdown_table)
    plots = getattr(suite, "PLOTS", None)
    measured: list[dict] = []  # every row as it is reported, kept when the run stops early
    # a suite's rows are known only as they come; its runs (one per --seq-lens value of kernels and layer) are
    # the total, with the rows so far beside them
    bar = tqdm(total=len(cases), desc=f"bench {args.suite}", unit="run", file=sys.stderr)

    def on_row(row: dict) -> None:
        measured.append(row)
        write_results(args.suite, measured, args.out, markdown=render, complete=False)
        bar.set_postfix(rows=len(measured))

    rows: list[dict] = []
    try:
        for case in cases:
            rows += run_suite(args.suite, case, device=device, world_size=world, port=args.port,
                              timeout_s=args.timeout, on_row=on_row)
            bar.update()
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
    if not torch.cuda.is_available():
        raise UsageError("needs a CUDA GPU and none is visible: it times FLA's kernels on it")
    if args.out is not None:
        _check_folder("--out", args.out)
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


# each command's function: its parsed arguments -> its exit status
COMMANDS = {"demo": _demo, "bench": _bench, "tune": _tune}


def run(args: argparse.Namespace) -> int:
    """Run the command of the parsed command line ``args`` (:func:`kdacp.options.parse_args`, with
    ``entered_at``: the command's entry, ``time.time()``); its exit status, 2 for a :class:`UsageError`
    (printed on one line)."""
    try:
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"kdacp {args.command}: {e}", file=sys.stderr)
        return 2
