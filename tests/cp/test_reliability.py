"""Reliability of ``chunk_kda`` / ``chunk_kda`` on CPU (gloo): bad numbers, determinism, extreme shapes.

* ``check_finite=True`` raises ``ValueError`` naming the argument (and, under CP, the rank) on every rank.
* By default a NaN in one sequence of a packed batch reaches that sequence's outputs and nothing of the
  other sequences: their outputs, final states and gradients are bitwise those of a NaN-free run (every
  strategy of ``STRATEGIES``, NaN in a sequence that crosses a rank edge and in one that does not).
* Two runs on the same inputs give bitwise-identical outputs and gradients (every strategy; the layer's
  state/ulysses/hybrid modes).
* Extreme shapes against the reference (float64): fewer tokens per rank than one chunk, 1-token pieces,
  2,000 packed sequences, gates at the lower bound (-5) and near 0.

One spawn per world size runs all its cases (the machine has 2 cores).
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from kdacp import reference
from kdacp.cp import STRATEGIES, build_cp_plan
from kdacp.ops.kda import chunk_kda
from kdacp.cp import ContextParallel
from kdacp.layers import KimiDeltaAttention
from kdacp.validation import FINITE_CHECKED
from tests.helpers import count_signature_gathers, make_kda_inputs, rel_err
from tests.multiprocess import run_ranks

TOKEN_INPUTS = ("q", "k", "v", "g", "beta")
NAN = float("nan")


# ----------------------------------------------------------------------------------------------
# helpers


def _poison(args: dict, name: str, index: tuple, value=NAN) -> dict:
    """``args`` with ``args[name][index] = value`` (a fresh leaf; the others are shared)."""
    x = args[name].detach().clone()
    x[index] = value
    return dict(args, **{name: x.requires_grad_(args[name].requires_grad)})


def _leaves(args: dict, lo: int | None = None, hi: int | None = None) -> dict:
    """Fresh leaves of ``args`` that require grad; token inputs cut to ``[lo, hi)`` when given."""
    out = {}
    for n, x in args.items():
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.detach()
            if lo is not None and n in TOKEN_INPUTS:
                x = x[:, lo:hi]
            x = x.clone().requires_grad_()
        out[n] = x
    return out


def _cp_run(args: dict, plan, lo: int, hi: int, do: torch.Tensor, dfinal: torch.Tensor | None,
            backward: bool = True):
    """This rank's ``chunk_kda`` outputs and gradients (per-rank shares for replicated inputs;
    none without ``backward``)."""
    local = _leaves(args, lo, hi)
    local.pop("cu_seqlens", None)
    o, final = chunk_kda(**local, output_final_state=dfinal is not None, backend="torch", cp=plan)
    loss = (o * do[:, lo:hi]).sum() + (0 if dfinal is None else (final * dfinal).sum())
    names = [n for n, x in local.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = dict(zip(names, torch.autograd.grad(loss, [local[n] for n in names], allow_unused=True))) \
        if backward else {}
    return o.detach(), None if final is None else final.detach(), grads


def _same(a, b, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    if not torch.equal(a, b):
        bad = (~torch.isfinite(a)).sum().item()
        diff = (a - b).abs().nan_to_num(float("inf")).max().item()
        raise AssertionError(f"{what}: not bitwise equal ({bad} non-finite, max |diff| {diff:.3e})")


def _segments(cu: list[int], lo: int, hi: int):
    """``(sequence, local_start, local_end)`` for every sequence overlapping tokens ``[lo, hi)``."""
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        if a < hi and b > lo:
            yield s, max(a, lo) - lo, min(b, hi) - lo


# ----------------------------------------------------------------------------------------------
# single device


def test_chunk_kda_check_finite_names_the_argument():
    cu = torch.tensor([0, 10, 70, 100])
    args = make_kda_inputs(1, 100, 1, 2, 16, 16, gate="default", initial_state=True, cu_seqlens=cu, seed=0)
    chunk_kda(**args, backend="torch", check_finite=True)  # finite: no error
    for name in FINITE_CHECKED:
        for value in (NAN, float("inf"), -float("inf")):
            index = (0,) * args[name].dim()
            with pytest.raises(ValueError, match=rf"chunk_kda: {name} holds NaN or Inf"):
                chunk_kda(**_poison(args, name, index, value), backend="torch", check_finite=True)
    # A_log / dt_bias are not read without the in-kernel gate, so they are not checked then.
    plain = make_kda_inputs(1, 20, 1, 1, 16, 16, seed=1)
    chunk_kda(**plain, A_log=torch.tensor([NAN]), backend="torch", check_finite=True)
    bad = _poison(_poison(plain, "q", (0, 3, 0, 1)), "beta", (0, 5, 0), float("inf"))
    with pytest.raises(ValueError, match="q, beta hold NaN or Inf"):
        chunk_kda(**bad, backend="torch", check_finite=True)
    chunk_kda(**bad, backend="torch")  # off by default: no check, no error


def test_chunk_kda_nan_stays_in_its_sequence():
    """A NaN in one sequence of a packed batch reaches its outputs and gradients, not the others'
    (which are bitwise those of the NaN-free run): NaN in g, v or the initial state."""
    cu = [0, 6, 76, 80, 100]  # the second sequence spans two chunks
    args = make_kda_inputs(1, 100, 1, 2, 16, 16, gate="default", initial_state=True,
                           cu_seqlens=torch.tensor(cu), seed=2)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(args["v"].shape, generator=gen, dtype=torch.float64)
    dfinal = torch.randn(args["initial_state"].shape, generator=gen, dtype=torch.float64)

    def run(a):
        leaves = _leaves(a)
        o, final = chunk_kda(**leaves, output_final_state=True, backend="torch")
        names = [n for n in (*TOKEN_INPUTS, "initial_state")]
        grads = torch.autograd.grad((o * do).sum() + (final * dfinal).sum(), [leaves[n] for n in names])
        return o.detach(), final.detach(), dict(zip(names, grads))

    clean = run(args)
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        for name in ("g", "v", "initial_state"):
            index = (s, 1, 3) if name == "initial_state" else (0, (a + b) // 2, args[name].shape[2] - 1) + (0,) * (args[name].dim() - 3)
            o, final, grads = run(_poison(args, name, index))
            where = f"NaN in {name} of sequence {s}"
            assert o[:, a:b].isnan().any(), f"{where}: did not reach its outputs"
            keep = torch.ones(cu[-1], dtype=torch.bool)
            keep[a:b] = False
            rows = [r for r in range(len(cu) - 1) if r != s]
            _same(o[:, keep], clean[0][:, keep], f"{where}: other sequences' outputs")
            _same(final[rows], clean[1][rows], f"{where}: other sequences' final states")
            for n in TOKEN_INPUTS:
                _same(grads[n][:, keep], clean[2][n][:, keep], f"{where}: other sequences' d{n}")
            _same(grads["initial_state"][rows], clean[2]["initial_state"][rows], f"{where}: other d initial_state")


# ----------------------------------------------------------------------------------------------
# context parallel: check_finite, NaN containment, determinism


def _nan_layouts(P: int, L: int) -> list[list[int]]:
    """Packed layouts over ``P`` ranks of ``L`` tokens: sequences local to one rank and sequences
    crossing each rank edge; for ``P >= 3`` also one spanning every rank (through ranks)."""
    cuts = [0, 6] + [x for r in range(1, P) for x in (r * L + 5, r * L + 12)] + [P * L]
    layouts = [cuts]
    if P >= 3:
        layouts.append([0, 6, (P - 1) * L + 3, P * L])
    return layouts


def _check_finite_cp(rank: int, P: int) -> None:
    """One rank's NaN makes every rank raise, naming that rank and argument; the others run on."""
    args = make_kda_inputs(1, 20, 1, 1, 16, 16, gate="default", initial_state=True, requires_grad=False, seed=5)
    plan = build_cp_plan(batch_size=1)
    chunk_kda(**args, backend="torch", cp=plan, check_finite=True)
    for name in FINITE_CHECKED:
        bad = _poison(args, name, (0,) * args[name].dim()) if rank == P - 1 else args
        with pytest.raises(ValueError, match=rf"NaN or Inf in the inputs \(rank {P - 1}: {name}\)"):
            chunk_kda(**bad, backend="torch", cp=plan, check_finite=True)
    # Two ranks at once, several arguments.
    bad = _poison(_poison(args, "v", (0, 1, 0, 2)), "g", (0, 2, 0, 3), float("inf")) if rank < 2 else args
    with pytest.raises(ValueError, match=r"rank 0: v, g; rank 1: v, g"):
        chunk_kda(**bad, backend="torch", cp=plan, check_finite=True)
    # Off (the default): no check; the same plan keeps working for finite inputs.
    chunk_kda(**_poison(args, "q", (0, 0, 0, 0)) if rank == 0 else args, backend="torch", cp=plan)
    o1, _ = chunk_kda(**args, backend="torch", cp=plan, check_finite=True)
    o2, _ = chunk_kda(**args, backend="torch", cp=plan)
    _same(o1, o2, "check_finite does not change the result")
    # The flag rides in the cross-rank check's all-gather, which then runs on every call.
    with count_signature_gathers() as gathers:
        for _ in range(3):
            chunk_kda(**args, backend="torch", cp=plan, check_finite=True)
        chunk_kda(**args, backend="torch", cp=plan)
        assert len(gathers) == 3
    # Ranks passing different check_finite are told on a plan's first call.
    fresh = build_cp_plan(batch_size=1)
    with pytest.raises(ValueError, match="disagree on check_finite"):
        chunk_kda(**args, backend="torch", cp=fresh, check_finite=rank == 0)
    dist.barrier()


def _nan_containment(rank: int, P: int) -> int:
    """For every layout, strategy, sequence and poisoned input: the other sequences' outputs, final
    states and gradients on this rank are bitwise those of the NaN-free run, and the NaN reaches
    its own sequence's outputs on some rank. Also checks two clean runs are bitwise equal."""
    L, cases = 24, 0
    for li, cu in enumerate(_nan_layouts(P, L)):
        args = make_kda_inputs(1, P * L, 1, 2, 16, 16, gate="default", initial_state=True,
                               cu_seqlens=torch.tensor(cu), seed=40 + li)
        gen = torch.Generator().manual_seed(50 + li)
        do = torch.randn(args["v"].shape, generator=gen, dtype=torch.float64)
        dfinal = torch.randn(args["initial_state"].shape, generator=gen, dtype=torch.float64) * (rank + 1)
        lo, hi = rank * L, (rank + 1) * L
        segs = list(_segments(cu, lo, hi))
        for strategy in STRATEGIES:
            plan = build_cp_plan(torch.tensor(cu), strategy=strategy)
            clean = _cp_run(args, plan, lo, hi, do, dfinal)
            again = _cp_run(args, plan, lo, hi, do, dfinal)
            _same(again[0], clean[0], f"determinism {strategy} layout {li}: o")
            for n, grad in clean[2].items():
                _same(again[2][n], grad, f"determinism {strategy} layout {li}: d{n}")
            for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
                crosses = a // L != (b - 1) // L
                t = a + 1  # on the sequence's first rank: with a crossing sequence the NaN travels on
                # one poisoned input per sequence, in turn over sequences and layouts (each strategy sees all three)
                for name in (("g", "v", "initial_state")[(s + li) % 3],):
                    index = (s, 1, 2) if name == "initial_state" else (0, t, args[name].shape[2] - 1) + (0,) * (args[name].dim() - 3)
                    o, final, grads = _cp_run(_poison(args, name, index), plan, lo, hi, do, dfinal)
                    where = (f"[{strategy}, P={P}, layout {li}, NaN in {name} of sequence {s} "
                             f"({'crossing' if crosses else 'local'}), rank {rank}]")
                    reached = torch.tensor([int(any(o[:, x:y].isnan().any() for q, x, y in segs if q == s))])
                    dist.all_reduce(reached)
                    assert reached.item() > 0, f"{where}: the NaN reached no output of its sequence"
                    rows = [r for r in range(len(cu) - 1) if r != s]
                    for q, x, y in segs:
                        if q == s:
                            continue
                        _same(o[:, x:y], clean[0][:, x:y], f"{where} o of sequence {q}")
                        for n in TOKEN_INPUTS:
                            _same(grads[n][:, x:y], clean[2][n][:, x:y], f"{where} d{n} of sequence {q}")
                    _same(final[rows], clean[1][rows], f"{where} final states of other sequences")
                    _same(grads["initial_state"][rows], clean[2]["initial_state"][rows],
                          f"{where} d initial_state of other sequences")
                    cases += 1
    return cases


# ----------------------------------------------------------------------------------------------
# extreme shapes against the reference


def _check_against_reference(rank: int, P: int, args: dict, lengths: list[int] | None, strategy: str,
                             what: str, sequences: list[int] | None = None, tol: float = 1e-9,
                             backward: bool = True) -> None:
    """``chunk_kda`` over ``lengths`` tokens per rank (equal split when None) against the
    reference: outputs, final states, token-input gradients and all-reduced shared gradients.
    ``sequences``: compare only these packed sequences (the reference runs on them alone; each
    sequence's outputs and token gradients depend on its own tokens only). ``backward=False``:
    outputs and final states only."""
    cu = args.get("cu_seqlens")
    B, T = args["q"].shape[:2]
    lengths = lengths or [T // P] * P
    lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(args["v"].shape, generator=gen, dtype=torch.float64)
    N = B if cu is None else len(cu) - 1
    dfinal = torch.randn(N, *args["v"].shape[2:3], args["q"].shape[3], args["v"].shape[3], generator=gen,
                         dtype=torch.float64)
    plan = build_cp_plan(cu, local_lengths=lengths, batch_size=None if cu is not None else B, strategy=strategy)
    # Each rank puts the same dfinal / P on the replicated final states: the reference sees dfinal.
    o, final, grads = _cp_run(args, plan, lo, hi, do, dfinal / P, backward)
    where = f"[{what}, {strategy}, P={P}, rank {rank}]"

    if sequences is None:
        ref_args, keep, rows = args, torch.ones(T, dtype=torch.bool), list(range(N))
    else:  # the reference on the chosen sequences only, packed
        cu_list = cu.tolist()
        rows = sequences
        idx = torch.cat([torch.arange(cu_list[s], cu_list[s + 1]) for s in rows])
        ref_args = {n: (x[:, idx] if n in TOKEN_INPUTS else x[rows] if n == "initial_state" else x)
                    for n, x in args.items() if n != "cu_seqlens"}
        ref_args["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(cu_list[s + 1] - cu_list[s] for s in rows)])
        keep = torch.zeros(T, dtype=torch.bool)
        keep[idx] = True
        do, dfinal = do[:, idx], dfinal[rows]
    leaves = _leaves(ref_args)
    ref_o, ref_final = reference.chunk_kda(**leaves, output_final_state=True)
    names = [n for n in grads if n in leaves and grads[n] is not None]
    ref_loss = (ref_o * do).sum() + (ref_final * dfinal).sum()
    ref_grads = dict(zip(names, torch.autograd.grad(ref_loss, [leaves[n] for n in names]))) if names else {}

    mine = keep[lo:hi]  # this rank's compared tokens, and where they sit in the reference's row
    at = torch.cumsum(keep.long(), 0)[lo:hi][mine] - 1
    assert rel_err(o[:, mine], ref_o[:, at]) < tol, f"{where} o: {rel_err(o[:, mine], ref_o[:, at]):.2e}"
    assert rel_err(final[rows], ref_final) < tol, f"{where} final state"
    for n in names:
        if n in TOKEN_INPUTS:
            got, want = grads[n][:, mine], ref_grads[n][:, at]
        else:
            got = grads[n].clone()
            dist.all_reduce(got)
            got, want = (got[rows] if n == "initial_state" else got), ref_grads[n]
            if sequences is not None and n != "initial_state":
                continue  # shared-parameter gradients sum over every sequence
        assert rel_err(got, want) < tol, f"{where} d{n}: {rel_err(got, want):.2e}"


def _tiny_ranks(rank: int, P: int) -> int:
    """5 tokens per rank (chunk 64): one sequence over every rank, batch rows, and packed cuts."""
    n = 0
    for strategy in STRATEGIES:
        one = make_kda_inputs(1, 5 * P, 1, 1, 16, 16, gate="default", initial_state=True, seed=60)
        _check_against_reference(rank, P, one, None, strategy, "5 tokens per rank, one sequence")
        rows = make_kda_inputs(2, 5 * P, 1, 2, 16, 16, gate="safe", initial_state=True, seed=61)
        _check_against_reference(rank, P, rows, None, strategy, "5 tokens per rank, B=2")
        packed = make_kda_inputs(1, 5 * P, 1, 1, 16, 16, gate="plain", initial_state=True,
                                 cu_seqlens=torch.tensor([0, 2, 5 * P - 1, 5 * P]), seed=62)
        _check_against_reference(rank, P, packed, None, strategy, "5 tokens per rank, packed")
        n += 3
    return n


def _one_token_pieces(rank: int, P: int) -> int:
    """Ranks holding a 1-token piece of a sequence: a 1-token through rank, a sequence whose last
    token is a rank's first, one whose first token is a rank's last, and a 1-token rank holding a
    whole 1-token sequence."""
    n = 0
    lengths = [20] * P
    lengths[1] = 1  # rank 1 holds one token
    T = sum(lengths)
    candidates = [
        None,                # one sequence: rank 1 is a 1-token piece (a through rank for P > 2)
        [0, 19, T],          # a sequence from rank 0's last token on, through rank 1's one token
        [0, 19, 21, T],      # rank 0's last token + rank 1's one token
        [0, 20, T],          # rank 1's one token starts a sequence that continues (P > 2)
        [0, 20, 21, T],      # rank 1 holds a whole 1-token sequence
        [0, 19, 22, T],      # 1 token on each of ranks 0, 1, 2
        [0, 10, T - 1, T],   # a 1-token sequence at the very end
    ]
    layouts = [cu for cu in candidates
               if cu is None or (cu[-1] == T and all(b > a for a, b in zip(cu[:-1], cu[1:])))]
    for strategy in STRATEGIES:
        for cu in layouts:
            args = make_kda_inputs(1, T, 1, 2, 16, 16, gate="default", initial_state=True,
                                   cu_seqlens=None if cu is None else torch.tensor(cu), seed=70 + n)
            _check_against_reference(rank, P, args, lengths, strategy, f"1-token piece, cu={cu}")
            n += 1
    return n


def _many_sequences(rank: int, P: int, num: int = 10_000) -> int:
    """``num`` short packed sequences (1-9 tokens) over ``P`` ranks, outputs and final states (26 s for
    10,000 on 2 ranks of the 2-core machine; the torch backend's per-sequence cost makes a backward
    over 2,000 sequences alone take ~30-50 s there, and gradients over many short sequences are in
    test_cp_chunk_kda.py); the reference checks the sequences at the rank edges and every 25th."""
    lens = [1 + (7 * i) % 9 for i in range(num)]
    cu = [0, *itertools.accumulate(lens)]
    T = cu[-1] - cu[-1] % P
    cu = [c for c in cu if c < T] + [T]
    args = make_kda_inputs(1, T, 1, 1, 16, 16, gate="default", initial_state=True, cu_seqlens=torch.tensor(cu),
                           seed=80)
    N = len(cu) - 1
    edges = {s for r in range(1, P) for s, _, _ in _segments(cu, r * T // P - 1, r * T // P + 1)}
    check = sorted(edges | set(range(0, N, 25)) | {N - 1})
    _check_against_reference(rank, P, args, None, STRATEGIES[0], f"{N} packed sequences", sequences=check,
                             backward=False)
    return N


def _extreme_gates(rank: int, P: int) -> int:
    """One sequence of 384 tokens per rank with gates at the lower bound -5 (plain g = -5 and the
    safe gate saturated) and near 0 (g = -1e-6, and the safe gate's logits very negative)."""
    n, T = 0, 384 * P
    for strategy in STRATEGIES:
        for value in (-5.0, -1e-6):
            args = make_kda_inputs(1, T, 1, 1, 16, 16, gate="plain", initial_state=True, seed=90)
            args["g"] = torch.full_like(args["g"], value).requires_grad_()
            _check_against_reference(rank, P, args, None, strategy, f"g = {value}")
            n += 1
        for logit in (30.0, -30.0):  # safe gate: g = -5 * sigmoid(exp(A_log) * (x + dt_bias)) -> -5 or ~0
            args = make_kda_inputs(1, T, 1, 1, 16, 16, gate="safe", initial_state=True, seed=91)
            args["g"] = (args["g"].detach() * 0.01 + logit).requires_grad_()
            _check_against_reference(rank, P, args, None, strategy, f"safe gate, logits ~ {logit}")
            n += 1
    return n


# ----------------------------------------------------------------------------------------------
# layer determinism


def _layer_determinism(rank: int, P: int, modes) -> int:
    n = 0
    for mode, ulysses_size in modes:
        for cu in (None, [0, 3, 11 * P - 1, 12 * P]):
            torch.manual_seed(0)
            layer = KimiDeltaAttention(32, 4, 4, head_k_dim=16, head_v_dim=16, conv_bias=True, backend="torch",
                                       cp=ContextParallel(mode, ulysses_size=ulysses_size)).double()
            B = 2 if cu is None else 1
            gen = torch.Generator().manual_seed(10 + rank)
            x = torch.randn(B, 12, 32, dtype=torch.float64, generator=gen)
            h0 = torch.randn(B if cu is None else len(cu) - 1, 4, 16, 16, dtype=torch.float64, generator=gen)
            w = torch.randn(B, 12, 32, dtype=torch.float64, generator=gen)
            runs = []
            for _ in range(2):
                xi, hi = x.clone().requires_grad_(), h0.clone().requires_grad_()
                layer.zero_grad()
                y, S = layer(xi, cu_seqlens=None if cu is None else torch.tensor(cu), initial_state=hi,
                             output_final_state=True)
                ((y * w).sum() + S.sum()).backward()
                runs.append([y.detach(), S.detach(), xi.grad, hi.grad, *(p.grad.clone() for p in layer.parameters())])
            for i, (a, b) in enumerate(zip(*runs)):
                _same(a, b, f"layer {mode} (U={ulysses_size}) packed={cu is not None} rank {rank}: tensor {i}")
            n += 1
    return n


# ----------------------------------------------------------------------------------------------
# spawns


def _run(rank: int, P: int) -> None:
    import time
    counts, times = {}, {}

    def timed(key, fn, *args):
        start = time.monotonic()
        counts[key] = fn(rank, P, *args)
        times[key] = round(time.monotonic() - start, 1)

    if P in (2, 3):
        timed("check_finite", _check_finite_cp)
        timed("nan", _nan_containment)
    timed("tiny", _tiny_ranks)
    timed("one-token", _one_token_pieces)
    if P == 2:
        timed("layer determinism", _layer_determinism, [("state", None), ("ulysses", None)])
        timed("gates", _extreme_gates)
        timed("many sequences", _many_sequences)
    if P == 4:
        timed("layer determinism", _layer_determinism, [("state", None), ("ulysses", None), ("hybrid", 2)])
    if rank == 0:
        print(f"P={P}: cases {counts}, seconds {times}", flush=True)


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_reliability(world_size):
    run_ranks(_run, world_size, timeout_s=240)
