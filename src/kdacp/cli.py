"""Command line: ``kdacp demo`` (a checked context-parallel training run), ``kdacp bench`` (benchmark suites) and ``kdacp tune``."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from .backends import BACKENDS
from .bench import CPU_SUITES, SUITES
from .bench.batches import BATCHES
from .demo import DTYPES
from .distributed.plan import STRATEGY_CHOICES
from .layers.context_parallel import MODES
from .workers import WorkerError, launch, under_torchrun


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


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 600,250,900,298, "
                                         f"got {text!r}")
    return values


def _rank_counts(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated numbers of ranks, each at least 2."""
    values = _lengths(text)
    if min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected comma-separated rank counts of at least 2, got {text!r}")
    return values


def _scaling_case(args: argparse.Namespace) -> dict:
    """The scaling suite's options from the command line (link figures converted to seconds and bytes/s)."""
    link = {name: value * scale for name, value, scale in (
        ("latency_s", args.link_latency_us, 1e-6), ("bandwidth", args.link_bandwidth_gbs, 1e9),
        ("gather_latency_s", args.gather_latency_us, 1e-6), ("gather_bandwidth", args.gather_bandwidth_gbs, 1e9))
        if value is not None}
    case = dict(t_local=args.seq_lens[0] if args.seq_lens else None, heads=args.heads, head_dim=args.head_dim,
                backend=args.backend, link=link or None, measured=args.measured, sleep_check=args.sleep_check)
    if args.predict_ranks:
        case["world_sizes"] = args.predict_ranks
    return case


def _print_demo_table(rows: list[dict], tol: float) -> bool:
    """The per-rank table, the step times and the verdict; True when every error is within ``tol``."""
    print(f"{'rank':>4} {'device':>8} {'tokens':>7} {'sequences':>9} {'first s':>8} {'later ms':>9} "
          f"{'output err':>11} {'loss err':>9} {'grad err':>9}")
    for r in rows:
        print(f"{r['rank']:>4} {r['device']:>8} {r['tokens']:>7} {r['sequences']:>9} {r['first_s']:>8.2f} "
              f"{r['later_ms']:>9.1f} {r['output_err']:>11.2e} {r['loss_err']:>9.2e} {r['grad_err']:>9.2e}")
    first, later = max(r["first_s"] for r in rows), max(r["later_ms"] for r in rows)
    print(f"step time (slowest rank): first step {first:.2f} s, "
          + (f"later steps {later:.1f} ms on average" if len(rows[0]["losses"]) > 1 else "no later steps"))
    slowest = max(rows, key=lambda r: r["first_s"])
    if slowest["precompiled"]:
        print(f"the first step includes {slowest['precompile_s']:.2f} s of compiling its {slowest['precompiled']} "
              f"new Triton kernels in parallel ahead of it (kdacp.precompile; --no-precompile leaves them to "
              f"compile one at a time as they first launch)")
    print("loss per step: " + ", ".join(f"{x:.4f}" for x in rows[0]["losses"]))
    worst = max(max(r["output_err"], r["loss_err"], r["grad_err"]) for r in rows)
    ok = worst <= tol
    if ok:
        print(f"PASS: context-parallel logits, loss and gradients match the one-process model "
              f"(largest relative error {worst:.2e}, tolerance {tol:.0e})")
    else:
        print(f"FAIL: largest relative error {worst:.2e} exceeds the tolerance {tol:.0e}")
    return ok


def _demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .demo import demo_config, demo_worker
    from .models import load_kimi_linear

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("kdacp demo: --device cuda was asked for but no CUDA GPU is visible; use --device cpu", file=sys.stderr)
        return 1
    world = args.world_size if args.world_size is not None else (torch.cuda.device_count() if device == "cuda" else 4)
    if under_torchrun():
        if args.world_size not in (None, int(os.environ["WORLD_SIZE"])):
            print(f"kdacp demo: --world-size {args.world_size} disagrees with torchrun's WORLD_SIZE="
                  f"{os.environ['WORLD_SIZE']}; leave it out under torchrun", file=sys.stderr)
            return 2
        world = int(os.environ["WORLD_SIZE"])
    cfg = demo_config(world, args.mode, ulysses_size=args.ulysses_size, num_heads=args.heads, head_dim=args.head_dim,
                      seq_lens=args.seq_lens, strategy=args.strategy, backend=args.backend, device=device,
                      dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"), steps=args.steps,
                      seed=args.seed, precompile=args.precompile)
    try:
        cfg.validate()
    except ValueError as e:
        print(f"kdacp demo: {e}", file=sys.stderr)
        return 2
    show = not under_torchrun() or int(os.environ["RANK"]) == 0
    if show:
        print(f"demo: {cfg.describe()}", flush=True)
    bar = tqdm(total=cfg.steps, desc=f"demo: {world} ranks, {cfg.mode}", disable=not show, file=sys.stderr)

    def on_report(rank, message):
        if rank == 0 and message[0] == "step":
            bar.n = message[1]
            bar.refresh()

    timeout = args.timeout if args.timeout is not None else (1800.0 if device == "cuda" else 300.0)
    if device == "cuda" and show:
        # Measured on 2 H200s before kdacp shipped FLA configurations: 127 s for the first step.
        print("kdacp demo: on a GPU the first step includes compiling the Triton kernels and FLA's autotuning "
              "of any kernel shape without a tuned configuration (kdacp ships the H200's); its time is "
              "printed at the end", file=sys.stderr)
    try:
        results = launch(demo_worker, world, (cfg,), device=device, port=args.port, timeout_s=timeout,
                         on_report=on_report, prepare=load_kimi_linear)
    except WorkerError as e:
        bar.close()
        print(f"kdacp demo: {e}", file=sys.stderr)
        return 1
    bar.close()
    if not show:
        return 0
    return 0 if _print_demo_table(results[0], cfg.tolerance) else 1


# The layer suite's defaults are sized for GPUs (16K tokens per rank, 2048 wide, 32 heads) and
# run for many minutes on CPU; these finish in seconds there.
_CPU_LAYER = dict(backend="torch", hidden=128, heads=4, head_dim=32, warmup=1, iters=3)
_CPU_T_LOCAL = 256

# The bench options that only some suites read: given to another suite, they are a usage error
# rather than silently unused.
_SUITE_OPTIONS = {"seq_lens": ("kernels", "cp", "gdn", "layer", "scaling", "overhead"),
                  "batches": ("cp", "layer", "gdn", "overhead"),
                  "trace": ("cp",), "world_size": ("cp", "layer", "soak", "scaling", "gdn"),
                  "backend": ("layer", "scaling", "overhead"), "hidden": ("layer",),
                  "heads": ("layer", "scaling", "overhead"), "head_dim": ("layer", "scaling", "overhead"),
                  "family": ("kernels", "cp", "overhead")}


def _unread_option(args: argparse.Namespace) -> str | None:
    """The message for the first bench option given that ``--suite`` does not read, or ``None``."""
    for name, suites in _SUITE_OPTIONS.items():
        if getattr(args, name) is not None and args.suite not in suites:
            flag = "--" + name.replace("_", "-")
            return f"{flag} is for --suite {' or '.join(suites)}, not --suite {args.suite}"
    return None


def _bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .bench import load_suite, run_suite
    from .bench.harness import markdown_table, write_results

    unread = _unread_option(args)
    if unread:
        print(f"kdacp bench: {unread}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if (device == "cuda" or args.suite not in CPU_SUITES) and not torch.cuda.is_available():
        print(f"kdacp bench: --suite {args.suite} needs a CUDA GPU and none is visible; the suites compare with "
              "FLA's CUDA kernels (only --suite layer --device cpu --backend torch, --suite virtual, --suite "
              "soak, --suite scaling and --suite overhead run without a GPU)",
              file=sys.stderr)
        return 1
    if args.backend == "fla" and device != "cuda":
        print(f"kdacp bench: --backend fla needs --device cuda (FLA's kernels are CUDA-only), got --device {device}; "
              "use --backend torch", file=sys.stderr)
        return 2
    if args.suite == "scaling" and args.seq_lens and len(args.seq_lens) > 1:
        print(f"kdacp bench: --suite scaling takes one --seq-lens value (tokens per rank), got {len(args.seq_lens)}",
              file=sys.stderr)
        return 2
    if args.measured is not None and not os.path.isfile(args.measured):
        print(f"kdacp bench: --measured {args.measured}: no such file", file=sys.stderr)
        return 2
    suite = load_suite(args.suite)
    world = args.world_size or (1 if args.suite == "gdn" else max(torch.cuda.device_count(), 1) if device == "cuda"
                                else 2)
    seq_lens = args.seq_lens
    if args.suite == "kernels":
        cases = [{"T": T, "family": args.family or "kda"} for T in (seq_lens or [16384])]
    elif args.suite in ("virtual", "soak"):
        cases = [{}]
    elif args.suite == "scaling":
        cases = [_scaling_case(args)]
    elif args.suite == "overhead":
        if seq_lens and len(seq_lens) > 1:
            print(f"kdacp bench: --suite overhead takes one --seq-lens value (tokens per rank), got {len(seq_lens)}",
                  file=sys.stderr)
            return 2
        cases = [dict(t_local=seq_lens[0] if seq_lens else None, heads=args.heads, head_dim=args.head_dim,
                      backend=args.backend, families=(args.family,) if args.family else ("kda", "gdn"))]
    elif args.suite == "gdn":
        cases = [{"t_locals": tuple(seq_lens or (16384, 32768))}]
    elif args.suite == "cp":
        cases = [{"t_locals": tuple(seq_lens or (16384, 32768)), "family": args.family or "kda"}]
        if args.trace:
            cases[0]["trace_dir"] = args.trace
    else:
        layer = {} if device == "cuda" else dict(_CPU_LAYER)
        given = dict(backend=args.backend, hidden=args.hidden, heads=args.heads, head_dim=args.head_dim)
        layer.update({name: value for name, value in given.items() if value is not None})
        cases = [{"t_local": T, **layer} for T in (seq_lens or [16384 if device == "cuda" else _CPU_T_LOCAL])]
    if args.batches:
        for case in cases:
            case["batches"] = args.batches
    rows: list[dict] = []
    bar = tqdm(desc=f"bench {args.suite}", unit="row", file=sys.stderr)
    try:
        for case in cases:
            got = run_suite(args.suite, case, device=device, world_size=world, port=args.port,
                            timeout_s=args.timeout, on_row=lambda row: bar.update())
            rows += got
    except Exception as e:  # noqa: BLE001 - a failed suite ends the command with its reason
        bar.close()
        print(f"kdacp bench: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    bar.close()
    render = getattr(suite, "markdown", markdown_table)
    paths = write_results(args.suite, rows, args.out, getattr(suite, "PLOTS", None), markdown=render)
    print(render(rows))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _tune(args: argparse.Namespace) -> int:
    from .tuning import tune
    try:
        paths = tune(args.out, t_local=tuple(args.seq_lens), hidden=args.hidden, heads=args.heads, head_dim=args.head_dim)
    except RuntimeError as e:
        print(f"kdacp tune: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(paths)} FLA configuration files into {paths[0].parent if paths else args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdacp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny Kimi Linear model context-parallel and check it against one "
                                       "process",
                          description="Train a tiny Hugging Face Kimi Linear model (KDA and MLA layers) under "
                                      "kdacp.parallelize for a few steps and check its logits, loss and gradients "
                                      "against the unmodified model in one process; prints the first step's time "
                                      "and the later steps' mean.")
    demo.add_argument("--world-size", type=_positive_int, default=None,
                      help="ranks to start (default: 4 on CPU, every GPU on CUDA)")
    demo.add_argument("--seq-lens", type=_lengths, default=(600, 250, 900, 298),
                      help="comma-separated lengths of the packed batch; their sum must split equally over the "
                           "ranks (default: 600,250,900,298)")
    demo.add_argument("--mode", default="state", choices=MODES,
                      help="state: time shards, state passed between ranks; ulysses: all-to-all to head shards; "
                           "hybrid: Ulysses in groups, state across them (default: %(default)s)")
    demo.add_argument("--ulysses-size", type=_positive_int, default=None,
                      help="--mode hybrid: ranks per Ulysses group, a divisor of the world size between 1 and it "
                           "(default: the smallest such divisor)")
    demo.add_argument("--heads", type=_positive_int, default=None,
                      help="heads of every KDA and MLA layer, a multiple of the world size (the MLA layers' "
                           "Ulysses attention splits them over all ranks) (default: 4 on CPU, 32 on CUDA, or the "
                           "world size's smallest multiple from there up)")
    demo.add_argument("--head-dim", type=_positive_int, default=None,
                      help="size of each head, even (default: 16 on CPU; 128 on CUDA, Kimi Linear's, at which the "
                           "shipped H200 kernel configurations were tuned)")
    demo.add_argument("--strategy", default="p2p", choices=STRATEGY_CHOICES,
                      help="how state passing exchanges states; auto: the cost model's pick for the plan "
                           "(default: %(default)s)")
    demo.add_argument("--backend", default="auto", choices=BACKENDS,
                      help="kdacp's KDA kernels: fla needs CUDA; auto picks fla on CUDA when installed, else torch "
                           "(default: %(default)s)")
    demo.add_argument("--device", default=None, choices=["cpu", "cuda"], help="(default: cuda when available)")
    demo.add_argument("--dtype", default=None, choices=DTYPES,
                      help="of the context-parallel model; the reference runs in float32 (no float64: "
                           "transformers' Kimi Linear computes in float32 inside) (default: float32 on CPU, "
                           "bfloat16 on CUDA)")
    demo.add_argument("--steps", type=_positive_int, default=3, help="training steps (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    demo.add_argument("--no-precompile", dest="precompile", action="store_false",
                      help="on a GPU, let the first step compile each Triton kernel as it first launches instead "
                           "of compiling them all in parallel ahead of it (kdacp.precompile)")
    demo.add_argument("--port", type=_port, default=0, help="rendezvous port; 0 picks a free one (default: %(default)s)")
    demo.add_argument("--timeout", type=_seconds, default=None,
                      help="seconds before the run is stopped (default: 300 on CPU; 1800 on CUDA, where FLA "
                           "autotunes kernel shapes without a tuned configuration at first use)")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="run a benchmark suite; writes JSON, Markdown and PNG plots")
    bench.add_argument("--suite", required=True, choices=SUITES)
    bench.add_argument("--seq-lens", type=_lengths, default=None,
                       help="comma-separated tokens (per rank for cp/layer); default 16384 (cp: 16K,32K; "
                            f"layer on CPU: {_CPU_T_LOCAL})")
    bench.add_argument("--batches", type=_batches, default=None,
                       help=f"cp/layer/overhead: comma-separated global batches from {', '.join(BATCHES)} (default: all)")
    bench.add_argument("--trace", default=None, metavar="DIR",
                       help="cp: also write a Chrome trace per rank and contender into DIR and add a per-rank "
                            "compute/wait/idle breakdown of one step to the rows")
    bench.add_argument("--family", default=None, choices=("kda", "gdn"),
                       help="kernels, cp and overhead suites: KDA (Kimi Linear's per-channel gate and shapes), or GDN "
                            "(the scalar gate at Qwen3-Next shapes) (default: kda; overhead: both)")
    bench.add_argument("--out", default="results", help="folder for the JSON, Markdown and PNG files")
    bench.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    bench.add_argument("--world-size", type=_positive_int, default=None,
                       help="ranks for cp, layer and soak (default: every GPU; 2 on CPU)")
    bench.add_argument("--backend", default=None, choices=[b for b in BACKENDS if b != "auto"],
                       help="layer and scaling suites: KDA backend (default: fla on CUDA, torch on CPU)")
    bench.add_argument("--hidden", type=_positive_int, default=None,
                       help=f"layer suite: hidden size (default 2048; {_CPU_LAYER['hidden']} on CPU)")
    bench.add_argument("--heads", type=_positive_int, default=None,
                       help=f"layer suite: heads (default 32; {_CPU_LAYER['heads']} on CPU); scaling: H = HV "
                            "(default 32; 2 on CPU)")
    bench.add_argument("--head-dim", type=_positive_int, default=None,
                       help=f"layer suite: head dim (default 128; {_CPU_LAYER['head_dim']} on CPU); scaling: K = V "
                            "(default 128; 32 on CPU)")
    bench.add_argument("--link-latency-us", type=_positive_float, default=None,
                       help="scaling suite: point-to-point latency in microseconds (replaces the measured or "
                            "default figure; default without a second rank: 20)")
    bench.add_argument("--link-bandwidth-gbs", type=_positive_float, default=None,
                       help="scaling suite: point-to-point bandwidth in GB/s (default without a second rank: 300)")
    bench.add_argument("--gather-latency-us", type=_positive_float, default=None,
                       help="scaling suite: all-gather latency per ring step in microseconds (default: 20)")
    bench.add_argument("--gather-bandwidth-gbs", type=_positive_float, default=None,
                       help="scaling suite: all-gather bandwidth per ring step in GB/s (default: 300)")
    bench.add_argument("--predict-ranks", type=_rank_counts, default=None,
                       help="scaling suite: comma-separated rank counts to predict (default: 2,4,...,1024)")
    bench.add_argument("--sleep-check", action="store_true",
                       help="scaling suite, two or more CPU ranks: also check the model's composition with ranks "
                            "whose stages sleep (no compute, so no contention for cores)")
    bench.add_argument("--measured", default=None, metavar="JSON",
                       help="scaling suite: a cp suite's JSON whose rows are drawn as measured points")
    bench.add_argument("--port", type=_port, default=0, help="rendezvous port (0: pick a free one)")
    bench.add_argument("--timeout", type=_seconds, default=1800.0,
                       help="seconds before a multi-rank run is stopped")
    bench.set_defaults(func=_bench)

    tune = sub.add_parser("tune", help="autotune FLA's kernels for kdacp's layer on this GPU and save the "
                                       "configurations (used instead of the shipped ones)",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tune.add_argument("--out", default=None, help="folder for the files (default: ~/.cache/kdacp/fla-configs/<GPU>)")
    tune.add_argument("--seq-lens", type=_positive_int, nargs="+", default=[16384, 2048],
                      help="tokens per call, one or several (some kernels tune per token count)")
    tune.add_argument("--hidden", type=_positive_int, default=2048)
    tune.add_argument("--heads", type=_positive_int, default=32)
    tune.add_argument("--head-dim", type=_positive_int, default=128)
    tune.set_defaults(func=_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
