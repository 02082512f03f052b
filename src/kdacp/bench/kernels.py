"""Summary kernels on one GPU, side by side with FLA 0.6.0's CP summary kernels and its main state pass.

KDA (``family="kda"``): inputs are real chunked-KDA intermediates (reference ``chunk_kda_intermediates``
in float32 on the GPU) rounded to bf16 (``gc`` float32); each result's relative error is taken against
the float64 reference summaries of exactly those values. Times are ``triton.testing.do_bench``
medians, warm.

GDN (``family="gdn"``, Qwen3-Next shapes: 16 q/k heads, 32 value heads, K=V=128, bf16): our scalar-gate
kernels in both forms (``gc [1, T, HV]``, the ``SCALAR_GATE`` variant; and a zero-stride ``[1, T, HV, K]``
view through the per-channel kernels) against FLA's GDN CP summary kernels (``chunk_cp_fwd_h`` and
``chunk_cp_bwd_dh`` with a scalar ``g``, as FLA's GDN CP pre-processing calls them). Both start from the
same bf16 ``q, k [1, T, 16, K]``, ``w, u, do, dv`` and float32 ``gc``; FLA gates ``q, k`` inside its
kernels, and so do ours with ``raw_keys=True`` (what kdacp's GDN backend runs); the other rows take
``qg, kg [1, T, 32, K]`` formed beforehand (a row times that, in PyTorch). Errors are
against float64 summaries of those shared inputs; times are CUDA-event means per call, warm, the
contenders taking turns (round robin) so that clock and thermal drift hit all alike.

Short convolution (``family="conv"``): kdacp's Triton kernels (:mod:`kdacp.kernels.short_conv`) against
FLA's ``causal_conv1d`` (Triton backend), SiLU, width 4, no bias, bf16, ``T`` tokens at 4096 channels (one
of q, k, v of Kimi Linear's 32 heads of 128) and 6144 (Qwen3-Next's fused q|k|v: 2048 x 3), one sequence
and 13 packed documents. Forward and backward (through autograd: FLA's backward recomputes its forward)
are timed round robin with the host queued ahead of the device (device time); ``GB/s`` counts the bytes
each pass must move (forward: read ``x``, write ``y``; backward: read ``x`` and ``dy``, write ``dx``).
Errors are against the float64 reference on the same bf16 inputs. Beside them, in the same round robin, torch's
own elementwise kernels moving the same bytes (``copy``: ``y = x``; ``add``: ``out = x + dy``): what the memory
system gives a kernel with no arithmetic to hide.

    kdacp bench --suite kernels [--seq-lens 16384] [--family gdn|conv]

``run(...)`` returns the table as a list of dicts; ``sweep(...)`` times tilings (to choose defaults).
"""
from __future__ import annotations

import logging
import math

import torch

from kdacp import kernels as kn
from kdacp import reference as ref
from kdacp.backends.fla_adapter import load_fla
from kdacp.kernels import short_conv
from kdacp.kernels.precision import resolve_precision
from kdacp.layers.short_conv import causal_conv1d as conv_reference

from .errors import rel_err
from .harness import PlotSpec
from .timing import time_round_robin

_log = logging.getLogger(__name__)

PLOTS = {"kernels": PlotSpec(x="kernel", y="ms", bars=True, panel="T", ylabel="ms (median, warm)",
                             title="state-summary kernels, B=1, HV=32, K=V=128, bf16,")}

# H200 SXM: dense bf16 tensor-core peak and HBM3e bandwidth, for the roofline column
PEAK_FLOPS = 989e12
PEAK_BYTES = 4.8e12
SCALE_DEFAULT = None  # K ** -0.5


def make_inputs(B=1, T=16384, HV=32, K=128, V=128, *, dtype=torch.bfloat16, device="cuda", seed=0):
    """Kernel inputs (``qg, kg, w, u, do, dv`` in ``dtype``, ``gc`` float32) from the reference chunked form."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = torch.nn.functional.normalize(rnd(B, T, HV, K), dim=-1)
    k = torch.nn.functional.normalize(rnd(B, T, HV, K), dim=-1)
    v, beta = rnd(B, T, HV, V), torch.sigmoid(rnd(B, T, HV) - 2.0)
    # per-channel gate biases from fast (2) to slow (12) decay: M stays far above underflow at 16K tokens
    bias = torch.linspace(2.0, 12.0, K, device=device)
    g = torch.nn.functional.logsigmoid(rnd(B, T, HV, K) + bias)
    with torch.no_grad():
        it = ref.chunk_kda_intermediates(q, k, v, g, beta)
    x = {n: getattr(it, n).to(dtype) for n in ("qg", "kg", "w", "u")}
    x["gc"] = it.gc.float()
    scale = K ** -0.5
    x["do"] = rnd(B, T, HV, V).to(dtype)
    x["dv"] = ref.chunk_dv_local(it.Aqk, x["do"].float(), scale).to(dtype)
    x["scale"] = scale
    return x


def reference_summaries(x):
    """Float64 ``S_ext, M, G`` of the (rounded) inputs."""
    d = {n: t.double() for n, t in x.items() if isinstance(t, torch.Tensor)}
    S, M = ref.state_summary(d["kg"], d["w"], d["u"], d["gc"])
    G = ref.state_gradient_summary(d["qg"], d["kg"], d["w"], d["gc"], d["do"], d["dv"], x["scale"])
    return {"S": S, "M": M, "G": G}


def median_ms(fn) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (25 ms warm-up, 100 ms of runs)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _costs(B, T, HV, K, V, BT, esize):
    """Logical FLOPs (one product per multiply-add pair counted as 2) and minimal bytes."""
    NT = B * math.ceil(T / BT)
    tok = B * T * HV
    ends = NT * HV * K * 4  # gc at each chunk's last token
    return {
        # per chunk: w S and kg^T v_new over V (+ K) columns
        "both": (NT * HV * 4 * BT * K * (V + K), tok * (2 * K + V) * esize + ends + B * HV * K * (V + K) * 4),
        "state": (NT * HV * 4 * BT * K * V, tok * (2 * K + V) * esize + ends + B * HV * K * V * 4),
        "transition": (NT * HV * 4 * BT * K * K, tok * 2 * K * esize + ends + B * HV * K * K * 4),
        # per chunk: kg dS, qg^T dO, w^T dv'
        "grad": (NT * HV * 6 * BT * K * V, tok * (3 * K + 2 * V) * esize + ends + B * HV * K * V * 4),
        # FLA main passes also write h per chunk (bf16) and v_new
        "fwd_h": (NT * HV * 4 * BT * K * V, tok * (2 * K + 2 * V) * esize + ends + NT * HV * K * V * esize),
    }


def _row(name, ms, cost, policy=None, **errs):
    """A kernel's row; ``policy``: the summary precision policy it ran (kdacp's kernels), else ``None``."""
    flops, nbytes = cost
    roof = max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e3
    row = {"kernel": name, "policy": policy or "", "ms": ms, "TFLOP/s": flops / ms / 1e9, "GB/s": nbytes / ms / 1e6,
           "GFLOP": flops / 1e9, "MB": nbytes / 1e6, "roofline_ms": roof}
    row.update({f"err_{k}": v for k, v in errs.items()})
    return row


def _fla_rows(x, r, costs, B, T, HV, K, V, BT):
    try:
        fla = load_fla()
    except ImportError as e:  # FLA is optional
        _log.warning(f"FLA not available ({e}); skipping its rows")
        return []
    rows = []
    hm = torch.zeros(HV, K, V + K, dtype=torch.float32, device=x["kg"].device)

    def fwd():
        fla.chunk_cp_fwd_h(k=x["kg"], w=x["w"], u=x["u"], hm=hm, gk=x["gc"], chunk_size=BT)

    fwd()
    ms = median_ms(fwd)
    rows.append(_row("FLA chunk_cp_fwd_h (S_ext+M)", ms, costs["both"], S=rel_err(hm[None, :, :, :V], r["S"]),
                     M=rel_err(hm[None, :, :, V:], r["M"])))
    dhm = torch.zeros_like(hm)

    def bwd():
        fla.chunk_cp_bwd_dh(q=x["qg"], k=x["kg"], w=x["w"], do=x["do"], dv=x["dv"], dhm=dhm, gk=x["gc"],
                            scale=x["scale"], chunk_size=BT)

    bwd()
    ms = median_ms(bwd)
    # FLA also forms dM (= M^T); its cost is in the time, the FLOP count is ours (G only)
    rows.append(_row("FLA chunk_cp_bwd_dh (G+dM)", ms, costs["grad"], G=rel_err(dhm[None, :, :, :V], r["G"]),
                     M=rel_err(dhm[None, :, :, V:], r["M"].transpose(-1, -2))))

    def main_fwd():
        return fla.chunk_gated_delta_rule_fwd_h(k=x["kg"], w=x["w"], u=x["u"], gk=x["gc"], output_final_state=True,
                                                chunk_size=BT)

    final = main_fwd()[2]
    ms = median_ms(main_fwd)
    rows.append(_row("FLA chunk_gated_delta_rule_fwd_h (main fwd pass)", ms, costs["fwd_h"], S=rel_err(final, r["S"])))
    h0 = torch.zeros(B, HV, K, V, dtype=torch.float32, device=x["kg"].device)

    def main_bwd():
        return fla.chunk_gated_delta_rule_bwd_dhu(q=x["qg"], k=x["kg"], w=x["w"], do=x["do"], dv=x["dv"], gk=x["gc"],
                                                  h0=h0, scale=x["scale"], chunk_size=BT)

    dh0 = main_bwd()[1]
    ms = median_ms(main_bwd)
    rows.append(_row("FLA chunk_gated_delta_rule_bwd_dhu (main bwd pass)", ms, costs["grad"], G=rel_err(dh0, r["G"])))
    return rows


def _sweep_cases(which):
    """(output or "grad", SummaryConfig) pairs around the defaults (at the default precision policy)."""
    C = kn.SummaryConfig
    if which == "fwd":
        cases = [("both", C(chunks_per_program=L)) for L in (64, 128, 256)]
        cases += [("both", C(chunks_per_program=128, num_stages=3)),
                  ("both", C(chunks_per_program=128, v_first=True)),
                  ("both", C(chunks_per_program=64, v_first=True)),
                  ("both", C(chunks_per_program=128, num_warps=2)),
                  ("both", C(chunks_per_program=128, num_warps=2, block_v=32)),
                  ("both", C(chunks_per_program=128, num_warps=8, v_first=True))]
        # three programs per SM (shared memory allows it transposed) need at most 170 registers
        cases += [("both", C(v_first=True, max_registers=r, chunks_per_program=L)) for r in (160, 168) for L in (64, 86)]
        cases += [("transition", C(chunks_per_program=L, v_first=vf)) for vf in (False, True) for L in (64, 128)]
        cases += [("state", C(v_first=vf)) for vf in (False, True)]
    else:
        C = kn.SummaryConfig
        cases = [("grad", C()), ("grad", C(block_v=16)), ("grad", C(num_stages=2)),
                 ("grad", C(num_warps=2)), ("grad", C(num_warps=2, block_v=16)), ("grad", C(num_warps=2, block_v=64)),
                 ("grad", C(v_first=True, block_v=64)), ("grad", C(v_first=True, block_v=32)),
                 ("grad", C(v_first=True, block_v=16)),
                 ("grad", C(v_first=True, block_v=64, chunks_per_program=128)),
                 ("grad", C(v_first=True, block_v=32, num_warps=2))]
    return cases


def sweep(x, r, costs, BT, which="fwd"):
    """Time tilings of our kernels (to choose defaults); rows named by their config."""
    rows = []
    gargs = (x["qg"], x["kg"], x["w"], x["gc"], x["do"], x["dv"], x["scale"])
    for output, cfg in _sweep_cases(which):
        tag = f"{output} " + " ".join(f"{k}={v}" for k, v in cfg.__dict__.items() if v is not None)
        try:
            if output == "grad":
                def fn():
                    return kn.state_gradient_summary(*gargs, chunk_size=BT, config=cfg)
                G = fn()
                torch.cuda.synchronize()
                errs = {"G": rel_err(G, r["G"])}
            else:
                def fn():
                    return kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=BT, output=output,
                                            config=cfg)
                S, M = fn()
                torch.cuda.synchronize()
                errs = {k: rel_err(v, r[k]) for k, v in (("S", S), ("M", M)) if v is not None}
            ms = median_ms(fn)
            rows.append(_row(f"sweep {tag}", ms, costs[output], **errs))
            print(f"sweep {tag}: {ms:.3f} ms {errs}", flush=True)
        except Exception as e:  # a tiling may not fit; a fault poisons the context, so stop there
            print(f"sweep {tag}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if "illegal" in str(e) or "CUDA error" in str(e):
                break
    return rows


def make_gdn_inputs(T=16384, H=16, HV=32, K=128, V=128, chunk_size=64, *, dtype=torch.bfloat16, device="cuda",
                    seed=0):
    """GDN kernel inputs for one sequence: FLA's ``q, k [1, T, H, K]`` and scalar ``g`` (log2 chunk
    cumsum, float32 ``[1, T, HV]``), our ``qg, kg [1, T, HV, K]`` and ``gc`` (the same ``g``), and the
    shared ``w, u, do, dv``; float64 ``S, M, G`` of exactly these values."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = torch.nn.functional.normalize(rnd(1, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(rnd(1, T, H, K), dim=-1)
    # one natural-log decay per token and value head, from faster to slower heads (as Qwen3-Next's
    # A_log spreads them); slow enough that M stays far above underflow over 32K tokens
    g = torch.nn.functional.logsigmoid(rnd(1, T, HV) + torch.linspace(6.0, 12.0, HV, device=device))
    with torch.no_grad():
        it = ref.chunk_kda_intermediates(q, k, rnd(1, T, HV, V), ref.scalar_gate_as_kda(g, K)[0],
                                         torch.sigmoid(rnd(1, T, HV) - 2.0), chunk_size=chunk_size)
    x = {"q": q.to(dtype), "k": k.to(dtype), "w": it.w.to(dtype), "u": it.u.to(dtype)}
    x["gc"] = it.gc[..., 0].float().contiguous()
    x["scale"] = K ** -0.5
    x["do"] = rnd(1, T, HV, V).to(dtype)
    x["dv"] = ref.chunk_dv_local(it.Aqk, x["do"].float(), x["scale"], chunk_size=chunk_size).to(dtype)
    del it
    x["qg"], x["kg"] = gdn_gated(x["q"], x["k"], x["gc"], chunk_size)
    # the truth: float64 from the shared inputs, the gating included
    d = {n: t.double() for n, t in x.items() if isinstance(t, torch.Tensor) and n not in ("qg", "kg")}
    qg, kg = gdn_gated(d["q"], d["k"], d["gc"], chunk_size)
    gc = d["gc"].unsqueeze(-1).expand(*d["gc"].shape, K)
    S, M = ref.state_summary(kg, d["w"], d["u"], gc, chunk_size=chunk_size)
    G = ref.state_gradient_summary(qg, kg, d["w"], gc, d["do"], d["dv"], x["scale"], chunk_size=chunk_size)
    return x, {"S": S, "M": M, "G": G}


def gdn_gated(q, k, gc, chunk_size):
    """``(qg, kg) [1, T, HV, K]`` in ``q``'s dtype: ``q exp2(gc)``, ``k exp2(gc_last - gc)`` for
    ``q, k [1, T, H, K]`` and a scalar gate ``gc [1, T, HV]`` (``T`` a multiple of ``chunk_size``)."""
    B, T, H, K = k.shape
    HV = gc.shape[2]
    gc = gc.float() if gc.dtype != torch.float64 else gc
    chunks = gc.view(B, T // chunk_size, chunk_size, HV)
    to_last = (chunks[:, :, -1:] - chunks).view(B, T, HV, 1)
    qg = q.repeat_interleave(HV // H, dim=2) * torch.exp2(gc)[..., None]
    kg = k.repeat_interleave(HV // H, dim=2) * torch.exp2(to_last)
    return qg.to(q.dtype), kg.to(k.dtype)


def _other_policies(dtype) -> list[str]:
    """The precision policies other than the default for ``dtype`` (none but the default where every policy
    runs float32 products)."""
    if dtype != torch.bfloat16:
        return []
    default = resolve_precision(None, dtype)
    return [p.value for p in kn.SummaryPrecision if p is not default]


def run_gdn(T=16384, H=16, HV=32, K=128, V=128, chunk_size=64, *, dtype=torch.bfloat16, with_fla=True,
            device="cuda", report=None, timing: dict | None = None):
    """The GDN rows (see the module docstring): ``kernel, ms, TFLOP/s, GB/s, GFLOP, MB, roofline_ms,
    err_*`` and ``speedup_vs_fla``. ``timing``: ``warmup``, ``rounds``, ``iters`` of
    :func:`~kdacp.bench.timing.time_round_robin` (default 3, 10, 5)."""
    if T % chunk_size:
        raise ValueError(f"T must be a multiple of chunk_size={chunk_size} here, got T={T}")
    x, r = make_gdn_inputs(T, H, HV, K, V, chunk_size, dtype=dtype, device=device)
    default = resolve_precision(None, dtype).value
    costs = _costs(1, T, HV, K, V, chunk_size, x["kg"].element_size())
    gates = {"scalar": x["gc"], "zero-stride K": x["gc"].unsqueeze(-1).expand(1, T, HV, K)}
    gargs = (x["qg"], x["kg"], x["w"])
    contenders = {}  # name -> (fn, cost, outputs -> errors)
    for form, gc in gates.items():
        contenders[f"kdacp state_summary (S_ext+M, {form} gate)"] = (
            lambda gc=gc: kn.state_summary(x["kg"], x["w"], x["u"], gc, chunk_size=chunk_size), costs["both"],
            lambda out: {"S": rel_err(out.offset, r["S"]), "M": rel_err(out.transition, r["M"])})
        contenders[f"kdacp state_gradient_summary (G, {form} gate)"] = (
            lambda gc=gc: kn.state_gradient_summary(*gargs, gc, x["do"], x["dv"], x["scale"], chunk_size=chunk_size),
            costs["grad"], lambda G: {"G": rel_err(G, r["G"])})
        # what the fla GDN backend runs: FLA's raw q, k [T, 16, K], gated inside the kernels
        contenders[f"kdacp state_summary (S_ext+M, {form} gate, raw k)"] = (
            lambda gc=gc: kn.state_summary(x["k"], x["w"], x["u"], gc, chunk_size=chunk_size, raw_keys=True),
            costs["both"], lambda out: {"S": rel_err(out.offset, r["S"]), "M": rel_err(out.transition, r["M"])})
        contenders[f"kdacp state_gradient_summary (G, {form} gate, raw q, k)"] = (
            lambda gc=gc: kn.state_gradient_summary(x["q"], x["k"], x["w"], gc, x["do"], x["dv"], x["scale"],
                                                    chunk_size=chunk_size, raw_keys=True),
            costs["grad"], lambda G: {"G": rel_err(G, r["G"])})
    for policy in _other_policies(dtype):  # the backend's path (raw keys, scalar gate) under the other policies
        contenders[f"kdacp state_summary (S_ext+M, scalar gate, raw k) [{policy}]"] = (
            lambda policy=policy: kn.state_summary(x["k"], x["w"], x["u"], x["gc"], chunk_size=chunk_size,
                                                   raw_keys=True, precision=policy),
            costs["both"], lambda out: {"S": rel_err(out.offset, r["S"]), "M": rel_err(out.transition, r["M"])})
        contenders[f"kdacp state_gradient_summary (G, scalar gate, raw q, k) [{policy}]"] = (
            lambda policy=policy: kn.state_gradient_summary(x["q"], x["k"], x["w"], x["gc"], x["do"], x["dv"],
                                                            x["scale"], chunk_size=chunk_size, raw_keys=True,
                                                            precision=policy),
            costs["grad"], lambda G: {"G": rel_err(G, r["G"])})
    contenders["kdacp state_summary (S_ext only, scalar gate)"] = (
        lambda: kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=chunk_size, output="state"),
        costs["state"], lambda out: {"S": rel_err(out.offset, r["S"])})
    # what our kernels need beyond FLA's inputs: the gated q, k per value head (an upper bound, eager)
    contenders["PyTorch qg, kg from q, k, gc (eager, ours need them)"] = (
        lambda: gdn_gated(x["q"], x["k"], x["gc"], chunk_size), (0, 4 * T * K * (H + HV)), lambda _: {})
    if with_fla:
        contenders.update(_fla_gdn_contenders(x, r, costs, HV, K, V, chunk_size))
    results = {name: fn() for name, (fn, _, _) in contenders.items()}
    timing = dict(warmup=3, rounds=10, iters=5) | (timing or {})
    ms = time_round_robin({name: fn for name, (fn, _, _) in contenders.items()}, group=None,
                          device=torch.device(device), **timing)
    rows = []
    for name, (_, cost, errors) in contenders.items():
        policy = name[name.index("[") + 1:-1] if name.endswith("]") else default if name.startswith("kdacp") else None
        row = {"T": T, **_row(name.split(" [")[0], ms[name], cost, policy, **errors(results[name]))}
        base = ("FLA chunk_cp_fwd_h" if "state_summary (S_ext+M" in name
                else "FLA chunk_cp_bwd_dh" if "state_gradient_summary" in name else None)
        fla = next((n for n in contenders if base and n.startswith(base)), None)
        if fla is not None:
            row["speedup_vs_fla"] = ms[fla] / ms[name]
        rows.append(row)
        if report is not None:
            report(row)
    return rows


def _fla_gdn_contenders(x, r, costs, HV, K, V, chunk_size) -> dict:
    """FLA's GDN CP summary kernels (scalar ``g``, raw ``q, k``), writing ``[S_ext | M]`` / ``[G | dM]``."""
    try:
        fla = load_fla()
    except ImportError as e:  # FLA is optional
        _log.warning(f"FLA not available ({e}); skipping its rows")
        return {}
    hm = torch.zeros(HV, K, V + K, dtype=torch.float32, device=x["k"].device)
    dhm = torch.zeros_like(hm)

    def fwd():
        fla.chunk_cp_fwd_h(k=x["k"], w=x["w"], u=x["u"], hm=hm, g=x["gc"], chunk_size=chunk_size)
        return hm

    def bwd():
        fla.chunk_cp_bwd_dh(q=x["q"], k=x["k"], w=x["w"], do=x["do"], dv=x["dv"], dhm=dhm, g=x["gc"],
                            scale=x["scale"], chunk_size=chunk_size)
        return dhm

    # FLA also forms dM (= M^T) in backward; its cost is in the time, the FLOP count is ours (G only)
    return {
        "FLA chunk_cp_fwd_h (S_ext+M, scalar g)": (
            fwd, costs["both"],
            lambda out: {"S": rel_err(out[None, :, :, :V], r["S"]), "M": rel_err(out[None, :, :, V:], r["M"])}),
        "FLA chunk_cp_bwd_dh (G+dM, scalar g)": (
            bwd, costs["grad"],
            lambda out: {"G": rel_err(out[None, :, :, :V], r["G"]),
                         "M": rel_err(out[None, :, :, V:], r["M"].transpose(-1, -2))}),
    }


def run(B=1, T=16384, HV=32, K=128, V=128, chunk_size=64, *, family="kda", dtype=torch.bfloat16, with_fla=True,
        do_sweep=None, device="cuda", report=None):
    """Time every kernel on one set of inputs; returns rows (dicts) with ``kernel, ms, TFLOP/s, GB/s,
    GFLOP, MB, roofline_ms, err_*`` (relative errors against the float64 reference) and speed-ups.
    ``family="gdn"``: the GDN rows of :func:`run_gdn` at Qwen3-Next shapes; ``family="conv"``: the
    short-convolution rows of :func:`run_conv` (``B``, ``HV``, ``K``, ``V`` and the sweep are KDA's)."""
    if family == "gdn":
        return run_gdn(T, chunk_size=chunk_size, dtype=dtype, with_fla=with_fla, device=device, report=report)
    if family == "conv":
        return run_conv(T, dtype=dtype, with_fla=with_fla, device=device, report=report)
    if family != "kda":
        raise ValueError(f"family must be 'kda', 'gdn' or 'conv', got {family!r}")
    x = make_inputs(B, T, HV, K, V, dtype=dtype, device=device)
    r = reference_summaries(x)
    default = resolve_precision(None, dtype).value
    costs = _costs(B, T, HV, K, V, chunk_size, x["kg"].element_size())
    if do_sweep:  # "fwd" or "grad": only the tiling sweep
        return sweep(x, r, costs, chunk_size, do_sweep)
    rows = []

    def add(row):
        row = {"T": T, **row}  # the plots' panel key
        rows.append(row)
        if report is not None:
            report(row)

    for output, key in (("both", "both"), ("state", "state"), ("transition", "transition")):
        S, M = kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=chunk_size, output=output)
        ms = median_ms(lambda: kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=chunk_size, output=output))
        errs = {}
        if S is not None:
            errs["S"] = rel_err(S, r["S"])
        if M is not None:
            errs["M"] = rel_err(M, r["M"])
        label = {"both": "S_ext+M", "state": "S_ext only", "transition": "M only"}[output]
        add(_row(f"kdacp state_summary ({label})", ms, costs[key], default, **errs))
    gargs = (x["qg"], x["kg"], x["w"], x["gc"], x["do"], x["dv"], x["scale"])
    G = kn.state_gradient_summary(*gargs, chunk_size=chunk_size)
    ms = median_ms(lambda: kn.state_gradient_summary(*gargs, chunk_size=chunk_size))
    add(_row("kdacp state_gradient_summary (G)", ms, costs["grad"], default, G=rel_err(G, r["G"])))
    # the other precision policies, and one layout alternative
    for policy in _other_policies(dtype):
        S, M = kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=chunk_size, precision=policy)
        ms = median_ms(lambda: kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=chunk_size,
                                                precision=policy))
        add(_row("kdacp state_summary (S_ext+M)", ms, costs["both"], policy, S=rel_err(S, r["S"]),
                 M=rel_err(M, r["M"])))
        G = kn.state_gradient_summary(*gargs, chunk_size=chunk_size, precision=policy)
        ms = median_ms(lambda: kn.state_gradient_summary(*gargs, chunk_size=chunk_size, precision=policy))
        add(_row("kdacp state_gradient_summary (G)", ms, costs["grad"], policy, G=rel_err(G, r["G"])))
    for name, cfg in (("G, v_first block_v=16", kn.SummaryConfig(v_first=True, block_v=16)),):
        G = kn.state_gradient_summary(*gargs, chunk_size=chunk_size, config=cfg)
        ms = median_ms(lambda: kn.state_gradient_summary(*gargs, chunk_size=chunk_size, config=cfg))
        add(_row(f"kdacp state_gradient_summary ({name})", ms, costs["grad"], default, G=rel_err(G, r["G"])))
    if with_fla:
        fla = _fla_rows(x, r, costs, B, T, HV, K, V, chunk_size)
        for row in fla:
            add(row)
        base = {row["kernel"].split(" (")[0]: row["ms"] for row in fla}
        for row in rows:
            if row["kernel"].startswith("kdacp state_summary (S_ext+M") and "FLA chunk_cp_fwd_h" in base:
                row["speedup_vs_fla"] = base["FLA chunk_cp_fwd_h"] / row["ms"]
            if row["kernel"].startswith("kdacp state_gradient_summary") and "FLA chunk_cp_bwd_dh" in base:
                row["speedup_vs_fla"] = base["FLA chunk_cp_bwd_dh"] / row["ms"]
    return rows


# --- short convolution ---------------------------------------------------------------------------------

CONV_WIDTHS = (4096, 6144)  # one of Kimi Linear's q, k, v (32 x 128); Qwen3-Next's fused q|k|v (2048 x 3)
CONV_DOCS = 13


def make_conv_inputs(T=16384, D=4096, W=4, *, packed=False, dtype=torch.bfloat16, device="cuda", seed=0):
    """``x``, ``dy [1, T, D]``, ``weight [D, W]`` in ``dtype`` and ``cu_seqlens`` (``packed``: 13 documents
    cut at random, on the device and the host; else None)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)

    x = {"x": rnd(1, T, D), "dy": rnd(1, T, D), "weight": rnd(D, W, scale=W ** -0.5), "cu": None, "cu_cpu": None}
    if packed:
        cuts = torch.randperm(T - 1, generator=gen)[:CONV_DOCS - 1].sort().values + 1
        x["cu_cpu"] = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])])
        x["cu"] = x["cu_cpu"].to(device)
    return x


def _conv_truth(x):
    """Float64 ``y`` and ``(dx, dweight)`` of the shared inputs."""
    xd, wd = x["x"].double().requires_grad_(), x["weight"].double().requires_grad_()
    y = conv_reference(xd, wd, cu_seqlens=x["cu_cpu"])
    dx, dw = torch.autograd.grad(y, [xd, wd], x["dy"].double())
    return y.detach(), dx, dw


def _conv_contenders(x, with_fla) -> dict:
    """name -> (forward fn, backward fn, which both return ``y`` / ``(dx, dweight)``)."""
    leaves = {"x": x["x"].detach().requires_grad_(), "w": x["weight"].detach().requires_grad_()}

    def ours():
        return short_conv.fused_causal_conv1d(x["x"], x["weight"], cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])

    y_ours = short_conv.fused_causal_conv1d(leaves["x"], leaves["w"], cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])
    found = {"kdacp": (ours, lambda: torch.autograd.grad(y_ours, [leaves["x"], leaves["w"]], x["dy"],
                                                         retain_graph=True))}
    if not with_fla:
        return found
    try:
        fla = load_fla()
    except ImportError as e:  # FLA is optional
        _log.warning(f"FLA not available ({e}); skipping its rows")
        return found
    fkw = dict(activation="silu", backend="triton", cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])

    def theirs():
        return fla.causal_conv1d(x=x["x"], weight=x["weight"], **fkw)[0]

    y_fla = fla.causal_conv1d(x=leaves["x"], weight=leaves["w"], **fkw)[0]
    found["FLA"] = (theirs, lambda: torch.autograd.grad(y_fla, [leaves["x"], leaves["w"]], x["dy"],
                                                        retain_graph=True))
    return found


def run_conv(T=16384, widths=CONV_WIDTHS, W=4, *, dtype=torch.bfloat16, with_fla=True, device="cuda", report=None,
             timing: dict | None = None):
    """The short-convolution rows (see the module docstring): ``kernel, D, layout, ms, GB/s, MB,
    pct_of_peak, err_*`` and ``speedup_vs_fla``. ``timing``: ``warmup``, ``rounds``, ``iters`` of
    :func:`~kdacp.bench.timing.time_round_robin` (default 3, 10, 10)."""
    timing = dict(warmup=3, rounds=10, iters=10) | (timing or {})
    rows = []
    for D in widths:
        for packed in (False, True):
            x = make_conv_inputs(T, D, W, packed=packed, dtype=dtype, device=device)
            y_ref, dx_ref, dw_ref = _conv_truth(x)
            contenders = _conv_contenders(x, with_fla)
            fns = {f"{name} {p}": fns[i] for name, fns in contenders.items() for i, p in enumerate(("fwd", "bwd"))}
            # what the memory system gives an elementwise kernel moving the same bytes: y = x; out = x + dy
            src, dy, sink = x["x"], x["dy"], torch.empty_like(x["x"])
            floors = {"copy fwd": lambda: sink.copy_(src), "copy bwd": lambda: torch.add(src, dy, out=sink)}
            ms = time_round_robin(fns | floors, group=None, device=torch.device(device),
                                  queue_ahead_ms=3.0 * timing["iters"], **timing)
            nbytes = {"fwd": 2 * T * D * x["x"].element_size(), "bwd": 3 * T * D * x["x"].element_size()}
            layout = f"{CONV_DOCS} documents" if packed else "one sequence"
            for name in (*floors, *fns):
                p = name.split()[-1]
                label = f"{name}: torch's {'copy' if p == 'fwd' else 'add'}, the same bytes" if name in floors else name
                row = {"T": T, "kernel": f"{label} (D={D}, {layout})", "D": D, "layout": layout, "ms": ms[name],
                       "GB/s": nbytes[p] / ms[name] / 1e6, "MB": nbytes[p] / 1e6,
                       "pct_of_peak": 100 * nbytes[p] / ms[name] * 1e3 / PEAK_BYTES}
                if name in fns:
                    out = fns[name]()
                    errs = ({"y": rel_err(out, y_ref)} if p == "fwd"
                            else {"dx": rel_err(out[0], dx_ref), "dw": rel_err(out[1], dw_ref)})
                    row.update({f"err_{k}": v for k, v in errs.items()})
                    if not name.startswith("FLA") and f"FLA {p}" in ms:
                        row["speedup_vs_fla"] = ms[f"FLA {p}"] / ms[name]
                rows.append(row)
                if report is not None:
                    report(row)
            del x, y_ref, dx_ref, dw_ref, contenders, fns
    return rows


def conv_tilings(p: str) -> list:
    """The tilings :func:`sweep_conv` tries for pass ``p`` (``"fwd"`` or ``"bwd"``): rows per program, channels
    and warps, a register cap or none, one or two groups per step, and for the backward one group loaded a
    step ahead or the loop software-pipelined in 3 stages."""
    import itertools
    steps = ((1, False, 1), (2, False, 1)) + (((1, True, 1), (1, False, 3)) if p == "bwd" else ())
    return [short_conv.ConvTiles(rows=r, BD=bd, num_warps=nw, maxnreg=reg, groups=g, ahead=a, stages=st)
            for r, (bd, nw), reg, (g, a, st) in itertools.product(
                (32, 64, 128, 256, 512),
                ((256, 2), (512, 4), (1024, 4), (1024, 8), (1024, 16), (2048, 8), (2048, 16)), (None, 128), steps)]


def conv_sweep_inputs(T=16384, D=4096, W=4, *, dtype=torch.bfloat16, device="cuda") -> list[tuple]:
    """The sweep's two cases, ``(label, launcher arguments (x, weight, bias, halo, cu_seqlens, activation), dy)``:
    one sequence, and 13 documents after a halo (:func:`make_conv_inputs`; no bias, SiLU)."""
    cases = []
    for packed in (False, True):
        x = make_conv_inputs(T, D, W, packed=packed, dtype=dtype, device=device)
        halo = x["x"][:, :W - 1].clone() if packed else None
        cases.append(("13 documents, halo" if packed else "one sequence",
                      (x["x"], x["weight"], None, halo, x["cu"], "silu"), x["dy"]))
    return cases


def sweep_conv(T=16384, D=4096, W=4, *, dtype=torch.bfloat16, device="cuda", passes=("fwd", "bwd")):
    """Time :func:`conv_tilings` of the forward and backward kernels (``passes``) on one sequence and on 13
    documents after a halo (to choose ``FWD_TILES`` / ``BWD_TILES``; compiled in parallel first). Prints and
    returns ``(pass, tiles, ms one sequence, ms documents, GB/s)`` rows and the fastest tiling of each pass
    (least summed time)."""
    from kdacp.precompilation import precompile
    cases = [(p, tiles) for p in passes for tiles in conv_tilings(p)]
    inputs = [(args, dy) for _, args, dy in conv_sweep_inputs(T, D, W, dtype=dtype, device=device)]

    def call(p, tiles, args, dy):
        return (short_conv.short_conv_fwd(*args, tiles=tiles) if p == "fwd"
                else short_conv.short_conv_bwd(*args, dy, tiles=tiles))

    import triton.testing
    precompile(lambda: [call(p, tiles, *i) for p, tiles in cases for i in inputs], device=device)
    rows, best = [], {}
    for p, tiles in cases:
        try:
            ms = [triton.testing.do_bench(lambda: call(p, tiles, *i), warmup=5, rep=25, return_mode="median")
                  for i in inputs]
        except Exception as e:  # a tiling may not fit
            print(f"sweep conv {p} {tiles}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        gbs = (2 if p == "fwd" else 3) * T * D * inputs[0][0][0].element_size() / ms[0] / 1e6
        rows.append({"pass": p, "tiles": str(tiles), "ms": ms[0], "ms_docs": ms[1], "GB/s": gbs})
        print(f"sweep conv {p} {tiles}: {ms[0]:.4f} ms, {ms[1]:.4f} ms (13 documents, halo), {gbs:.0f} GB/s",
              flush=True)
        if p not in best or sum(ms) < best[p][1]:
            best[p] = (tiles, sum(ms))
    return rows, {p: tiles for p, (tiles, _) in best.items()}
