"""``chunk_kda`` and ``chunk_gated_delta_rule`` over any token layout on gloo ranks against the float64
reference on the global batch: zigzag (batch rows, with the split read from the call, and packed sequences),
per-document zigzag with documents of every size class (a token, shorter than a convolution window of 4,
shorter than a 64-token chunk, longer than a rank's tokens), the balanced placement of the same documents
(P = 3; long ones cut per document, short ones whole or cut to fill a rank), and random caller ranges (uneven,
several per rank, ranges of a few tokens, cut anywhere); every strategy, initial and final states, grouped value heads.
Every output, final state and gradient at 1e-9. Each case's reference runs once, then every strategy."""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kdacp import reference
from kdacp.cp import STRATEGIES, build_cp_plan
from kdacp.cp.layout import (TokenLayout, balanced_document_layout, contiguous_layout, make_layout,
                             ranges_layout)
from kdacp.ops.gdn import chunk_gated_delta_rule
from kdacp.ops.kda import chunk_kda
from kdacp.reference.gdn import recurrent_gated_delta_rule
from tests.helpers import make_kda_inputs, rel_err
from tests.multiprocess import run_ranks
from tests.test_gdn import gdn_inputs

TOKEN_INPUTS = ("q", "k", "v", "g", "beta")
ALL_STRATEGIES = STRATEGIES + ("auto",)


def random_ranges(num_tokens: int, world_size: int, seed: int) -> TokenLayout:
    """Ranges cut at random points (one of 2 tokens among them), about three a rank, each rank holding at
    least one, given to ranks at random."""
    rng = random.Random(seed)
    pieces = 3 * world_size
    cuts = set(rng.sample(range(1, num_tokens - 3), pieces - 2))
    cuts.add(max(cuts) + 2)  # a range of 2 tokens
    bounds = [0, *sorted(cuts), num_tokens]
    owners = list(range(world_size)) + [rng.randrange(world_size) for _ in range(len(bounds) - 1 - world_size)]
    rng.shuffle(owners)
    ranges = [[] for _ in range(world_size)]
    for (s, e), r in zip(zip(bounds[:-1], bounds[1:]), owners):
        ranges[r].append((s, e))
    return ranges_layout(ranges, num_tokens)


def _documents(lengths) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def layout_cases(P: int) -> list[dict]:
    """Cases: ``op`` (kda or gdn), ``B``, ``cu`` (global boundaries or None), ``layout`` (a name or a
    TokenLayout), ``init``/``final`` states."""
    # a token, shorter than W = 4, shorter than a chunk, longer than a chunk, longer than a rank's tokens
    docs = _documents([1, 3, 2, 30, 70, 80 * P, 13])
    packed = _documents([5, 40 * P - 9, 4, 20 * P])
    rows_T = 30 * P
    return [
        dict(name="zigzag-rows-open-split", op="kda", B=2, cu=None, T=2 * P * 15, layout="zigzag", init=True,
             final=True),
        dict(name="zigzag-packed", op="kda", B=1, cu=packed, layout="zigzag", init=True, final=True),
        dict(name="document-zigzag-size-classes", op="kda", B=1, cu=docs, layout="document_zigzag", init=True,
             final=True),
        # long documents cut per document, short ones whole (some cut to fill a rank's room), a rank holding many
        dict(name="balanced-documents", op="kda", B=1, cu=docs,
             layout=balanced_document_layout(docs, P, whole_below=20), init=True, final=True),
        dict(name="random-ranges-packed", op="kda", B=1, cu=packed, layout=random_ranges(packed[-1], P, 7 * P),
             init=True, final=True),
        # a training step: no states, batch rows, ranges of any length
        dict(name="random-ranges-rows-no-states", op="kda", B=2, cu=None, T=rows_T,
             layout=random_ranges(rows_T, P, 11 * P), init=False, final=False),
        dict(name="gdn-document-zigzag", op="gdn", B=1, cu=docs, layout="document_zigzag", init=True, final=True),
        dict(name="gdn-random-ranges-rows", op="gdn", B=2, cu=None, T=rows_T, layout=random_ranges(rows_T, P, 13 * P),
             init=True, final=True),
    ]


def _inputs(case: dict, seed: int) -> dict:
    """float64 inputs, H = 1 and HV = 2, states that last across ranges (a slowly fading gate)."""
    cu = case["cu"]
    T = case["T"] if cu is None else cu[-1]
    if case["op"] == "kda":
        args = make_kda_inputs(case["B"], T, 1, 2, 16, 16, gate="default", initial_state=case["init"],
                               cu_seqlens=None if cu is None else torch.tensor(cu), seed=seed, gate_shift=-4.0)
        args.pop("cu_seqlens", None)
        return args
    args = gdn_inputs(case["B"], T, 1, 2, 16, 16, gate_in_kernel=False, cu=cu, init=case["init"], seed=seed)
    args.pop("cu_seqlens", None)
    gen = torch.Generator().manual_seed(seed + 1)
    args["g"] = F.logsigmoid(torch.randn(args["g"].shape, generator=gen, dtype=torch.float64) + 4.0).requires_grad_()
    return args


def _reference(case: dict, args: dict, cu):
    if case["op"] == "kda":
        return reference.chunk_kda(**args, cu_seqlens=cu, output_final_state=True)
    return recurrent_gated_delta_rule(**args, cu_seqlens=cu, output_final_state=True)


def check_layout_case(rank: int, world_size: int, case: dict, seed: int, strategies=ALL_STRATEGIES,
                      split=None) -> None:
    """One case on every strategy: outputs, final states and every gradient at 1e-9 (float64). ``split``: the
    ops' ``split=``."""
    args = _inputs(case, seed)
    cu = None if case["cu"] is None else torch.tensor(case["cu"])
    total = args["q"].shape[1]
    layout = case["layout"] if isinstance(case["layout"], TokenLayout) else make_layout(
        case["layout"], world_size, total, case["cu"])
    index = layout.local_token_index(rank)
    final = case["final"]
    gen = torch.Generator().manual_seed(seed + 2)
    do = torch.randn(args["v"].shape, generator=gen, dtype=torch.float64)
    N = case["B"] if cu is None else len(cu) - 1
    # each rank puts its own gradient on the replicated final states; the reference sees their sum
    dfinal = [torch.randn(N, *args["v"].shape[2:3], args["q"].shape[3], args["v"].shape[3], generator=gen,
                          dtype=torch.float64) for _ in range(world_size)]
    ref_o, ref_final = _reference(case, args, cu)
    ref_loss = (ref_o * do).sum() + (final and (ref_final * sum(dfinal)).sum())
    names = [n for n, x in args.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    ref_grads = dict(zip(names, torch.autograd.grad(ref_loss, [args[n] for n in names])))
    op = chunk_kda if case["op"] == "kda" else chunk_gated_delta_rule
    for strategy in strategies:
        local = {n: (x[:, index].detach().clone().requires_grad_() if n in TOKEN_INPUTS else
                     x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) else x)
                 for n, x in args.items()}
        plan = build_cp_plan(cu, layout=case["layout"], batch_size=None if cu is not None else case["B"],
                             strategy=strategy)
        assert plan.layout_for(len(index)) == layout and plan.strategy in STRATEGIES
        o, final_state = op(**local, output_final_state=final, backend="torch", cp=plan, split=split)
        loss = (o * do[:, index]).sum() + (final and (final_state * dfinal[rank]).sum())
        grads = dict(zip(names, torch.autograd.grad(loss, [local[n] for n in names])))
        where = f"[{case['name']}, {strategy}, rank {rank}/{world_size}]"
        assert rel_err(o, ref_o[:, index]) < 1e-9, f"{where} o: {rel_err(o, ref_o[:, index]):.2e}"
        if final:
            assert rel_err(final_state, ref_final) < 1e-9, f"{where} final_state: {rel_err(final_state, ref_final):.2e}"
        else:
            assert final_state is None
        for n in names:
            got, want = grads[n], ref_grads[n]
            if n in TOKEN_INPUTS:
                want = want[:, index]
            else:  # parameter and initial-state gradients are per-rank shares that add up
                dist.all_reduce(got)
            assert rel_err(got, want) < 1e-9, f"{where} d{n}: {rel_err(got, want):.2e}"


def _bad_layouts(rank: int, world_size: int) -> None:
    """Refused by name before anything blocks: layout with local_lengths, a layout of another size, and a
    rank passing tokens other than its ranges' (every rank raises, none waits)."""
    with pytest.raises(ValueError, match="layout or local_lengths"):
        build_cp_plan(torch.tensor([0, 40 * world_size]), layout="zigzag", local_lengths=[40] * world_size)
    with pytest.raises(ValueError, match="layout must"):
        build_cp_plan(torch.tensor([0, 40 * world_size]), layout="ring")
    with pytest.raises(ValueError, match="layout must cover"):
        build_cp_plan(torch.tensor([0, 40 * world_size]), layout=make_layout("zigzag", world_size, 41 * world_size))
    # the plan's layout: fixed where the batch is, resolved per call for rows of a length the call gives
    assert build_cp_plan(torch.tensor([0, 40 * world_size])).layout == contiguous_layout(40 * world_size, world_size)
    assert build_cp_plan(batch_size=2, layout="zigzag").layout is None
    uneven = random_ranges(40 * world_size, world_size, 3)
    plan = build_cp_plan(torch.tensor([0, 40 * world_size]), layout=uneven)
    args = make_kda_inputs(1, 40, 1, 1, 16, 16, requires_grad=False, seed=0)  # 40 tokens on every rank
    if all(n == 40 for n in uneven.local_lengths):
        raise AssertionError("the layout must be uneven for this check")
    with pytest.raises(ValueError, match=r"layout.local_lengths|rejected"):
        chunk_kda(**args, backend="torch", cp=plan)
    dist.barrier()


def _run(rank: int, world_size: int, names) -> None:
    if names is None:
        _bad_layouts(rank, world_size)
    for i, case in enumerate(layout_cases(world_size)):
        if names is None or case["name"] in names:
            check_layout_case(rank, world_size, case, seed=1000 * world_size + i)


# P = 2: the cases of every mechanism once (zigzag's first and last ranks hold both ends of the chain);
# P = 3 every case (a through position on a rank of two); P = 4 with -m slow
_P2 = ("zigzag-rows-open-split", "document-zigzag-size-classes", "random-ranges-packed", "gdn-random-ranges-rows")


@pytest.mark.parametrize("world_size, names", [(2, _P2), (3, None), pytest.param(4, None, marks=pytest.mark.slow)])
def test_ops_over_any_layout_match_reference(world_size, names):
    run_ranks(_run, world_size, names, timeout_s=600)
