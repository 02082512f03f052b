"""The ``kdacp`` command line's parser: its commands, options, their checks and help texts.

Built without torch (the choices come from :mod:`kdacp.choices`), so that ``kdacp --help``, ``kdacp <command>
--help`` and ``kdacp --version`` answer at once; the commands themselves are :mod:`kdacp.commands`.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys

from .choices import (BACKENDS, BATCHES, CPU_SUITES, DEMO_DTYPES, LAYOUTS, MODES, STRATEGY_CHOICES, SUITES,
                      USER_CONFIGS, VERSION, VIRTUAL_CHUNK, SummaryPrecision)

DESCRIPTION = ("Command line: kdacp demo (a checked context-parallel training run), kdacp bench (benchmark suites) "
               "and kdacp tune (FLA's kernel configurations for this GPU).")


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
    """argparse type: comma-separated batch names of :data:`kdacp.choices.BATCHES`."""
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
    """Comma-separated integers, each at least ``low``; else an argparse error naming ``what`` was expected
    (and the first value below ``low``)."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < low:
        below = next((f" ({v} is {'not positive' if low == 1 else f'below {low}'})" for v in values if v < low), "")
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}{below}")
    return values


def _lengths(text: str) -> tuple[int, ...]:
    return _int_list(text, 1, "comma-separated positive integers such as 600,250,900,298")


def _modes(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated context-parallel modes of :data:`kdacp.choices.MODES`."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names or any(n not in MODES for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated modes from {', '.join(MODES)}, got {text!r}")
    return names


def _layouts(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated token layouts of :data:`kdacp.choices.LAYOUTS`."""
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
LINK_OPTIONS = {
    "--link-latency-us": ("latency_s", 1e-6, "point-to-point latency in microseconds (replaces the measured or "
                                             "default figure; default without a second rank: 20)"),
    "--link-bandwidth-gbs": ("bandwidth", 1e9, "point-to-point bandwidth in GB/s (default without a second rank: 300)"),
    "--gather-latency-us": ("gather_latency_s", 1e-6, "all-gather latency per ring step in microseconds (default: 20)"),
    "--gather-bandwidth-gbs": ("gather_bandwidth", 1e9, "all-gather bandwidth per ring step in GB/s (default: 300)"),
}


# The layer suite's defaults are sized for GPUs (16K tokens per rank, 2048 wide, 32 heads) and
# run for many minutes on CPU; these finish in seconds there.
CPU_LAYER = dict(backend="torch", hidden=128, heads=4, head_dim=32, warmup=1, iters=3)


CPU_T_LOCAL = 256


# What each choice of an option means, in its help text (:func:`_add_choice`).
_MODE_MEANINGS = {"state": "time shards, state passed between ranks", "ulysses": "all-to-all to head shards",
                  "hybrid": "Ulysses in groups, state across them"}


_STRATEGY_MEANINGS = {"p2p": "hop by hop along the ranks", "allgather": "every rank gathers every summary",
                      "scan": "recursive doubling, log2 P rounds",
                      "auto": "the cost model's pick for the plan, printed at the end"}


_BACKEND_MEANINGS = {"auto": "on CUDA with FLA installed, fla for KDA, and for GDN attn_gym on a Hopper GPU where "
                             "installed (training calls within its limits), else fla; torch without CUDA or FLA "
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


# The exit statuses of every command (``kdacp --help``'s epilog; the README says the same).
EXIT_STATUS = ("exit status: 0 success, 1 a failed check or run, 2 a usage error or missing hardware or package "
               "(before anything runs), 130 interrupted (Ctrl-C; every worker is stopped first; 128 + N for another "
               "stopping signal N)")


def build_parser() -> argparse.ArgumentParser:
    """The ``kdacp`` parser; each command's parser is its namespace's ``parser`` (for errors in its own usage)."""
    # before or after the command; absent from the namespace unless given (a default would be the command's too,
    # the actions being shared, and overwrite a count given before it)
    verbosity = argparse.ArgumentParser(add_help=False)
    verbosity.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                           help="more of kdacp's log messages: -v its progress, -vv debugging")
    verbosity.add_argument("-q", "--quiet", action="count", default=argparse.SUPPRESS,
                           help="fewer: errors only (default: warnings and errors)")
    parser = argparse.ArgumentParser(prog="kdacp", description=DESCRIPTION, epilog=EXIT_STATUS, parents=[verbosity])
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", parents=[verbosity], help="train a tiny Kimi Linear model context-parallel and check it against one "
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
    demo.add_argument("--dtype", default=None, choices=DEMO_DTYPES,
                      help="of the context-parallel model; the reference runs in float32 (no float64: "
                           "transformers' Kimi Linear computes in float32 inside) (default: float32 on CPU, "
                           "bfloat16 on CUDA)")
    demo.add_argument("--steps", type=_positive_int, default=3, help="training steps (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights and batches (default: %(default)s)")
    demo.add_argument("--no-precompile", dest="precompile", action="store_false",
                      help="on a GPU, let the first step compile each Triton kernel as it first launches instead "
                           "of compiling them all in parallel ahead of it (kdacp.precompile)")
    demo.set_defaults(parser=demo)

    bench = sub.add_parser("bench", parents=[verbosity], help="run a benchmark suite; writes JSON, Markdown and PNG plots",
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
                            f"131072; cp and gdn 16384,32768; layer 16384, on CPU {CPU_T_LOCAL}; virtual "
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
                       help=f"layer suite: hidden size (default 2048; {CPU_LAYER['hidden']} on CPU)")
    bench.add_argument("--heads", type=_positive_int, default=None,
                       help=f"layer suite: heads (default 32; {CPU_LAYER['heads']} on CPU); scaling: H = HV "
                            "(default 32; 2 on CPU); virtual: HV (default 2)")
    bench.add_argument("--head-dim", type=_positive_int, default=None,
                       help=f"layer suite: head dim (default 128; {CPU_LAYER['head_dim']} on CPU); scaling: K = V "
                            "(default 128; 32 on CPU); virtual: K = V (default 16)")
    for flag, (_, _, text) in LINK_OPTIONS.items():
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
    bench.set_defaults(parser=bench)

    tune = sub.add_parser("tune", parents=[verbosity], help="autotune FLA's kernels for kdacp's layer on this GPU and save the "
                                       "configurations, which kdacp then prefers over the shipped ones",
                          description="Autotune FLA's kernels for kdacp's KimiDeltaAttention layer at the given "
                                      "sizes on this GPU and save the configurations. By default they go to "
                                      f"{USER_CONFIGS}/<GPU name>, where kdacp looks first: it then uses them "
                                      "instead of the ones it ships (tuned on the H100 80GB and the "
                                      "H200, and taken by other GPUs of their architecture), so a first run on this GPU no "
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
    tune.set_defaults(parser=tune)
    return parser


# an option's value that argparse would take for an option: a negative number or list of numbers
_NEGATIVE = re.compile(r"-[0-9.]")


def _values_joined(argv: list[str]) -> list[str]:
    """``argv`` with each long option followed by a negative value (``--seq-lens -5,100``) joined into one
    ``--seq-lens=-5,100``, so that the value reaches the option's own check."""
    joined: list[str] = []
    for word in argv:
        if joined and _NEGATIVE.match(word) and joined[-1].startswith("--") and "=" not in joined[-1]:
            joined[-1] += "=" + word
        else:
            joined.append(word)
    return joined


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line ``argv`` (default: ``sys.argv[1:]``) parsed; an error (exit status 2) in the usage of
    the command it belongs to, naming any unknown option."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(_values_joined(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}" if unknown
                     else "the following arguments are required: command")
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def log_level(args: argparse.Namespace) -> int:
    """The ``kdacp`` logger's level for the parsed ``-v``/``-q``: WARNING by default, INFO with ``-v``, DEBUG
    with ``-vv``, ERROR with ``-q``."""
    return logging.WARNING - 10 * max(-1, min(getattr(args, "verbose", 0) - getattr(args, "quiet", 0), 2))
