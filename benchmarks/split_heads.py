"""The split inside one GPU against FLA's ops, over the head counts tensor parallelism leaves on a GPU.

For each family (KDA with Kimi Linear's gate: in kernel, safe, lower bound -5, q/k L2 norm in kernel; GDN with
Qwen3-Next's log-decay gate given, q/k L2 norm in kernel), head count (``H = HV``, K = V = 128, bf16), token count
and batch (one sequence, or log-normal packed documents of median 2,048 tokens), times forward and forward +
backward of FLA's op beside kdacp's with each ``split`` setting (``none``, ``auto``, or pieces of the longest
sequence), the contenders taking turns on the device clock (:func:`kdacp.bench.timing.median_times`); and beside
them:

- for GDN where it is installed (``benchmarks/flashqla_prep.sh``), FlashQLA's op with its own intra-card context
  parallelism (``flashqla``: ``auto_cp=True``, its default) and without (``flashqla_nocp``), and kdacp's op on it
  (``kdacp_flashqla``: ``backend="flashqla"``, no split);
- kdacp's op on attention-gym's cores (``kdacp_attn_gym``: ``backend="attn_gym"``, no split) where they are
  installed on a Hopper GPU (its forward-only calls run FLA's kernels);
- with ``--graphs``, FLA's op and each split setting replayed from a CUDA graph (``"<name> graph"``: the
  device's time without the host's launches between kernels).

The forward is timed as inference, under ``torch.no_grad()``: kdacp's GDN then runs FLA's GDN kernels even where
FLA refuses its GDN backward (which a training forward prepares for by running FLA's KDA kernels on the broadcast
gate instead). Prints one line per case (ms, and each contender over FLA) and, with ``--out DIR``, writes
``split_heads.json`` and ``.md`` (one row per case and contender, the card named) and one plot per family and mode
(time against heads, one line per contender, one panel per token count and batch).

    python benchmarks/split_heads.py --heads 2,4,8,16,32 --tokens 16384,65536,262144 \
        --batches one_sequence,lognormal --out DIR
"""
from __future__ import annotations

import argparse
import signal
import sys

import torch
import torch.nn.functional as F

from kdacp.bench.batches import cu_seqlens_of, document_lengths
from kdacp.bench.harness import PlotSpec, write_results
from kdacp.bench.inputs import random_inputs
from kdacp.bench.timing import capture, median_times


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def split_setting(name: str):
    return None if name == "none" else name if name == "auto" else int(name)


def op_inputs(family: str, T: int, H: int, cu) -> tuple[dict, dict]:
    """``(tensors, options)`` for both ops, the tensors leaves that require grad."""
    x = random_inputs(T, H, H, 128, 128, gate=family)
    options = dict(use_qk_l2norm_in_kernel=True, output_final_state=True,
                   cu_seqlens=None if cu is None else torch.tensor(cu, device="cuda"))
    if family == "kda":
        options.update(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=x["A_log"].float(),
                       dt_bias=x["dt_bias"].float())
        tensors = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    else:  # the log decay, as Qwen3-Next's layer forms it before the op
        g = (-x["A_log"].float().exp() * F.softplus(x["g"].float() + x["dt_bias"].float())).to(x["q"].dtype)
        tensors = dict(q=x["q"], k=x["k"], v=x["v"], g=g, beta=x["beta"])
    return {n: t.detach().requires_grad_() for n, t in tensors.items()}, options


def timed_call(op, tensors: dict, options: dict, backward: bool):
    do = torch.randn_like(tensors["v"])

    def call():
        if not backward:  # a forward alone is inference (prefill): no graph, and no backward to prepare for
            with torch.no_grad():
                op(**tensors, **options)
            return
        o, _ = op(**tensors, **options)
        o.backward(do)
        for t in tensors.values():
            t.grad = None
    return call


def _flashqla():
    """FlashQLA's ``chunk_gated_delta_rule`` (FLA's GDN signature, and ``auto_cp``), or None (said once) where it is
    not installed or the GPU is not a Hopper or Blackwell one."""
    try:
        from flash_qla import chunk_gated_delta_rule
    except ImportError as error:
        print(f"# FlashQLA left out: {error}")
        return None
    if torch.cuda.get_device_capability()[0] < 9:
        print(f"# FlashQLA left out: it runs on Hopper and Blackwell, this is {torch.cuda.get_device_name()}")
        return None
    return chunk_gated_delta_rule


def _attn_gym_runs() -> bool:
    """Whether kdacp's ``attn_gym`` backend runs here (said once where it does not)."""
    from kdacp.backends import BACKEND_SPECS
    runs, reason = BACKEND_SPECS["attn_gym"].availability(torch.device("cuda"))
    if not runs:
        print(f"# attention-gym left out: {reason}")
    return runs


def plots(rows: list[dict]) -> dict[str, PlotSpec]:
    """One plot per family and mode of ``rows``: milliseconds against heads, a line per contender, a panel per
    token count and batch."""
    return {f"split_heads_{family}_{mode}": PlotSpec(
        x="heads", y="ms", series="contender", panel="tokens_batch", where=("family_mode", f"{family} {mode}"),
        title=f"{family.upper()} {mode.replace('_', ' + ')}: kdacp's split, FLA and the peers against heads",
        ylabel="ms", logy=True)
        for family, mode in dict.fromkeys((r["family"], r["mode"]) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="kda,gdn")
    parser.add_argument("--heads", type=_ints, default=[2, 4, 8, 16, 32])
    parser.add_argument("--tokens", type=_ints, default=[65536])
    parser.add_argument("--batches", default="one_sequence")
    parser.add_argument("--splits", default="none,auto,8,16,32")
    parser.add_argument("--modes", default="forward,forward_backward")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--graphs", action="store_true",
                        help="also FLA's op and each split setting captured in a CUDA graph and replayed")
    parser.add_argument("--out", default=None, help="folder for split_heads.json, .md and the plots")
    args = parser.parse_args()

    import kdacp  # first: it points FLA at its kernel configurations, which FLA reads at import
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    from fla.ops.kda import chunk_kda as fla_kda
    flashqla = _flashqla()
    attn_gym = _attn_gym_runs()
    from kdacp.backends.fla_adapter import fla_gated_gdn_backward_supported
    fla_gdn_backward = fla_gated_gdn_backward_supported()
    if not fla_gdn_backward:  # FLA 0.6.0 on Hopper with Triton < 3.7.1 and no tilelang
        print("# FLA's GDN op left out of forward + backward: it refuses its backward here (install tilelang, or "
              "Triton >= 3.7.1); kdacp's GDN then trains on FLA's KDA kernels")
    rows = []
    card = torch.cuda.get_device_name()
    print(f"# {card}, torch {torch.__version__}")
    # a run stopped by its time limit (SIGTERM, as timeout sends) still writes the rows it finished
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    complete = False
    try:
        _sweep(args, rows, card, flashqla, attn_gym, fla_gdn_backward, fla_kda, fla_gdn)
        complete = True
    finally:
        if args.out and rows:
            for path in write_results("split_heads", rows, args.out, plots=plots(rows), complete=complete):
                print(f"# wrote {path}")


def _sweep(args, rows: list, card: str, flashqla, attn_gym, fla_gdn_backward, fla_kda, fla_gdn) -> None:
    """Time every contender of ``args``' grid, appending a row per contender to ``rows`` as each call set ends."""
    import kdacp
    for family in args.families.split(","):
        fla_op, ours = (fla_kda, kdacp.chunk_kda) if family == "kda" else (fla_gdn, kdacp.chunk_gated_delta_rule)
        for T in args.tokens:
            for batch in args.batches.split(","):
                cu = None if batch == "one_sequence" else cu_seqlens_of(document_lengths(batch, T))
                for H in args.heads:
                    tensors, options = op_inputs(family, T, H, cu)
                    for mode in args.modes.split(","):
                        backward = mode == "forward_backward"
                        fns = {}
                        if family == "kda" or not backward or fla_gdn_backward:
                            fns["fla"] = timed_call(fla_op, tensors, options, backward)
                        for name in args.splits.split(","):
                            fns[f"split={name}"] = timed_call(ours, tensors, dict(options, split=split_setting(name)),
                                                              backward)
                        if family == "gdn" and flashqla is not None:
                            for name, auto_cp in (("flashqla", True), ("flashqla_nocp", False)):
                                fns[name] = timed_call(flashqla, tensors, dict(options, auto_cp=auto_cp), backward)
                            fns["kdacp_flashqla"] = timed_call(ours, tensors, dict(options, backend="flashqla"),
                                                               backward)
                        if attn_gym:
                            fns["kdacp_attn_gym"] = timed_call(ours, tensors, dict(options, backend="attn_gym"),
                                                               backward)
                        if args.graphs:  # FLA's op and each cut replayed from a CUDA graph: no host between kernels
                            for name in ["fla", *(f"split={n}" for n in args.splits.split(","))]:
                                if name in fns:
                                    fns[f"{name} graph"] = capture(fns[name])[0].replay
                        seconds = median_times(fns, torch.device("cuda"), rounds=args.rounds, warmup=2)
                        ms = {n: s * 1e3 for n, s in seconds.items()}
                        fla = ms.get("fla")
                        rows += [dict(card=card, family=family, tokens=T, batch=batch, heads=H, mode=mode,
                                      contender=n, ms=t, over_fla=None if fla is None else t / fla,
                                      family_mode=f"{family} {mode}", tokens_batch=f"{T} {batch}")
                                 for n, t in ms.items()]
                        ratios = " ".join(f"{n} {t:.3f}" + ("" if fla is None else f" ({t / fla:.2f}x)")
                                          for n, t in ms.items() if n != "fla")
                        head = "fla refuses" if fla is None else f"fla {fla:.3f}"
                        print(f"{family} T={T} {batch} H={H} {mode}: {head} ms | {ratios}", flush=True)
                    del tensors
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
