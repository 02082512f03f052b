"""``kdacp bench --suite overhead --layouts``: the rank roles under zigzag layouts and the balanced placement.

- The roles stand for every rank: at each ``P``, every rank's segments (lengths, flags, how they group into
  ranges) are those of the role standing for it, and the roles differ from one another.
- The roles' timed calls are the op: every rank of the plan, run as the suite runs a role (its
  ``rank_step`` against the ready exchange) but handed the true incoming states and state gradients, gives
  the float64 reference's outputs and gradients on its tokens, and passes on the reference's states.
- The suite runs on the CPU (torch backend, tiny sizes): each role's extra stages in the breakdown, the step
  model's rows, the CLI's options.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from kdacp import reference
from kdacp.backends.base import KDAInputs
from kdacp.bench.overhead import (ReadyExchange, _rank_roles, layout_batch, layout_role_plans, layout_role_ranks,
                                  rank_step, role_call, run)
from kdacp.cli import main
from kdacp.cp.plan import layout_rank_layouts


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _signature(layout) -> tuple:
    """A rank's work, whatever its ranks' places in the chain: per segment its length, flags and the index
    of its range among the rank's."""
    local = {p: k for k, p in enumerate(layout.positions)}
    return tuple((s.end - s.start, s.receives, s.sends, local[s.position]) for s in layout.segments)


CASES = [("zigzag", "one_sequence"), ("document_zigzag", "docs7"), ("document_zigzag", "lognormal")]


@pytest.mark.parametrize("layout, batch", CASES)
@pytest.mark.parametrize("P", [2, 3, 8, 64])
def test_roles_stand_for_every_rank(layout, batch, P):
    T = 256
    cu, token_layout = layout_batch(layout, batch, T, P)
    assert token_layout.local_lengths == (T,) * P
    layouts = layout_rank_layouts(cu, 1, token_layout)
    roles = layout_role_ranks(P)
    assert list(roles) == (["ends", "turn"] if P == 2 else ["ends", "middle", "turn"])
    for rank, role in enumerate(_rank_roles(layout, P)):
        assert _signature(layouts[rank]) == _signature(layouts[roles[role]]), (rank, role)
    # the roles are different work: ends two ranges, one only sending and one only receiving; middle two
    # through ranges; turn one range per document (P-1 and P joined)
    kinds = {role: _signature(layouts[rank]) for role, rank in roles.items()}
    assert len(set(kinds.values())) == len(kinds)
    ends = layouts[0]
    assert any(s.sends and not s.receives for s in ends.segments)
    assert any(s.receives and not s.sends for s in ends.segments)
    if P > 2:
        assert all(s.receives and s.sends for s in layouts[1].segments)
        assert len(layouts[1].positions) == 2 * len(layouts[P - 1].positions)


def _chunk_kda(args: dict, **options):
    """The chunked reference on ``args``, a GDN call's scalar gate (``g [1, T, HV]``, ``dt_bias [HV]``, the
    kind its backend gets) broadcast over ``K`` (its gradients summed back)."""
    if args["g"].dim() == 3:
        g, dt_bias = reference.scalar_gate_as_kda(args["g"], args["q"].shape[-1], args.get("dt_bias"))
        args = dict(args, g=g, dt_bias=dt_bias)
    return reference.chunk_kda(**args, **options)


def _prefix_state(args: dict, options: dict, bos: int, t: int) -> torch.Tensor:
    """The reference's state after global tokens ``[bos, t)`` of one document, ``[1, HV, K, V]``."""
    sliced = {n: x[:, bos:t] if x.dim() > 2 else x for n, x in args.items()}
    return _chunk_kda(sliced, **options, output_final_state=True)[1]


def _state_gradient(args: dict, options: dict, do: torch.Tensor, bos: int, t: int, eos: int) -> torch.Tensor:
    """The gradient of ``<o, do>`` over tokens ``[t, eos)`` of the document ``[bos, eos)`` reaching the state at
    token ``t``, ``[1, HV, K, V]``."""
    state = _prefix_state(args, options, bos, t).detach().requires_grad_()
    sliced = {n: x[:, t:eos] if x.dim() > 2 else x for n, x in args.items()}
    o, _ = _chunk_kda(sliced, **options, initial_state=state)
    return torch.autograd.grad((o * do[:, t:eos]).sum(), state)[0]


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("layout, batch, P", [("zigzag", "one_sequence", 2), ("zigzag", "one_sequence", 3),
                                              ("document_zigzag", "docs7", 2), ("document_zigzag", "lognormal", 3),
                                              ("balanced_documents", "lognormal", 3)])
def test_every_rank_run_as_a_role_gives_the_reference(one_thread, family, layout, batch, P):
    T = 64
    plans = layout_role_plans(layout, batch, T, P)
    plan = next(iter(plans.values()))[0]
    token_layout, cu = plan.layout, plan.cu_seqlens or (0, P * T)
    call, do = role_call(family, "torch", P * T, 2, 8, torch.float64, torch.device("cpu"))
    opts = call.backend.options
    options = dict(scale=opts.scale, use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=opts.use_gate_in_kernel, lower_bound=opts.lower_bound, cu_seqlens=None)
    args = {n: x.detach() for n, x in vars(call.inputs).items()}
    leaves = {n: x.clone().requires_grad_() for n, x in args.items()}
    ref_o, _ = _chunk_kda(leaves, **{**options, "cu_seqlens": torch.tensor(cu)})
    ref_grads = dict(zip(leaves, torch.autograd.grad(ref_o, list(leaves.values()), do)))

    def document(t: int) -> tuple[int, int]:  # the document [bos, eos) a cut at token t lies inside
        n = max(i for i, c in enumerate(cu) if c < t)
        return cu[n], cu[n + 1]
    chain, L = token_layout.chain, len(token_layout.chain)

    def forward_value(route, i):  # the state entering chain position i
        return _prefix_state(args, options, document(chain[i].start)[0], chain[i].start)

    def backward_value(route, i):  # the gradient reaching the state leaving chain position L-1-i
        bos, eos = document(chain[L - 1 - i].end)
        return _state_gradient(args, options, do, bos, chain[L - 1 - i].end, eos)

    o = torch.zeros_like(ref_o)
    grads = {n: torch.zeros_like(x) for n, x in args.items()}
    for rank in range(P):
        idx = token_layout.local_token_index(rank)
        mine = KDAInputs(**{n: x[:, idx] if x.dim() > 2 else x for n, x in args.items()})
        exchange = ReadyExchange(incoming=forward_value)
        fwd, bwd = rank_step(call.backend, dataclasses.replace(plan, rank=rank), dataclasses.replace(call, inputs=mine),
                             do[:, idx], torch.float64, exchange)
        o[:, idx] = fwd().o
        for i, sent in exchange.passed.items():  # the state leaving position i, where the chain goes on
            want = _prefix_state(args, options, document(chain[i].end)[0], chain[i].end)
            torch.testing.assert_close(sent, want, rtol=1e-9, atol=1e-12)
        exchange.incoming_at = backward_value
        got = bwd()
        for i, sent in exchange.passed.items():  # the gradient leaving chain position L-1-i backward
            bos, eos = document(chain[L - 1 - i].start)
            torch.testing.assert_close(sent, _state_gradient(args, options, do, bos, chain[L - 1 - i].start, eos),
                                       rtol=1e-9, atol=1e-12)
        for n in ("q", "k", "v", "g", "beta"):
            grads[n][:, idx] = getattr(got, f"d{n}")
        for n in ("A_log", "dt_bias"):
            grads[n] += getattr(got, f"d{n}")
    torch.testing.assert_close(o, ref_o, rtol=1e-9, atol=1e-12)
    for n, want in ref_grads.items():
        torch.testing.assert_close(grads[n], want, rtol=1e-9, atol=1e-12, msg=lambda m, n=n: f"d{n}: {m}")


def _by(rows, source):
    return [r for r in rows if r["source"] == source]


def _stages(rows, P, role):
    return {r["stage"]: r for r in _by(rows, "breakdown") if r["P"] == P and r["role"] == role}


def test_zigzag_roles_run_their_extra_stages(one_thread):
    rows = run(t_local=64, families=("kda",), batches=("one_sequence",), heads=1, head_dim=8, device="cpu",
               layouts=("contiguous", "zigzag"), world_sizes=(2, 3))
    overhead = [r for r in _by(rows, "overhead") if r["layout"] == "zigzag"]
    assert [(r["P"], r["role"], r["rank"], r["positions"]) for r in overhead] == [
        (2, "ends", 0, 2), (2, "turn", 1, 1), (3, "ends", 0, 2), (3, "middle", 1, 2), (3, "turn", 2, 1)]
    for r in _by(rows, "overhead"):
        for name in ("ratio", "base_ratio", "fwd_ratio", "bwd_ratio"):
            assert math.isfinite(r[name]) and r[name] > 0, (name, r)
    # ends: a state pass over its first chunk for its message besides the whole pass, and G for its last
    # chunk's message; no transition (nothing of it is inside the chain)
    ends = _stages(rows, 3, "ends")
    assert (ends["state_pass"]["calls"], ends["state_pass"]["one_calls"]) == (2, 1)
    assert (ends["state_gradient_summary"]["calls"], ends["state_gradient_summary"]["one_calls"]) == (1, 0)
    assert "state_summary" not in ends and "apply" not in ends
    # middle and turn: S_ext + M, G, and every chunk's M x + S (one stage call per direction)
    for role in ("middle", "turn"):
        got = _stages(rows, 3, role)
        for stage, calls in (("state_summary", 1), ("state_gradient_summary", 1), ("apply", 2)):
            assert (got[stage]["calls"], got[stage]["one_calls"]) == (calls, 0), (role, got[stage])
    # the stage probe's pieces for every role and direction; ends blocks before its whole pass
    stages = {(r["P"], r["role"], r["direction"]): r for r in _by(rows, "stages") if r["layout"] == "zigzag"}
    assert len(stages) == 10
    assert stages[3, "ends", "forward"]["after_ms"] > 0
    # the step model: every layout at every P, measured and by share, each strategy
    step = _by(rows, "step model")
    assert {(r["layout"], r["P"], r["stages"]) for r in step} == {
        (layout, P, how) for P in (2, 3) for layout, how in
        (("contiguous", "measured"), ("zigzag", "measured"), ("zigzag", "contiguous by share"))}
    assert all(math.isfinite(r[f"{s}_ratio"]) and r[f"{s}_ratio"] > 0 for r in step for s in ("p2p", "scan"))
    assert all(r["best_ratio"] == min(r[f"{s}_ratio"] for s in ("p2p", "allgather", "scan")) for r in step)


def test_cli_layouts(one_thread, tmp_path, capsys):
    tiny = ["bench", "--suite", "overhead", "--device", "cpu", "--seq-lens", "64", "--heads", "1", "--head-dim", "8",
            "--family", "gdn", "--out", str(tmp_path)]
    assert main([*tiny, "--batches", "docs7", "--layouts", "zigzag,document_zigzag", "--ranks", "2"]) == 0
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    # a packed batch runs the per-document zigzag where both are asked for
    assert {(r["layout"], r["P"]) for r in _by(rows, "overhead")} == {("document_zigzag", 2)}
    assert not _by(rows, "step model")  # one sequence only
    assert "### per-rank forward + backward over one device" in capsys.readouterr().out
    assert main([*tiny, "--ranks", "2"]) == 2
    assert "--ranks is for the overhead suite's layouts other than contiguous" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*tiny, "--layouts", "stripes"])
    with pytest.raises(ValueError, match="t_local must be even"):
        run(t_local=63, families=("kda",), batches=("one_sequence",), device="cpu", layouts=("zigzag",))
    with pytest.raises(ValueError, match="layouts must be from"):
        run(t_local=64, device="cpu", layouts=("stripes",))


@pytest.mark.parametrize("P", [3, 8])
def test_balanced_documents_time_their_busiest_rank(P):
    T = 1024
    plans = layout_role_plans("balanced_documents", "lognormal", T, P)
    assert list(plans) == ["busiest"]
    plan = plans["busiest"][0]
    counts = [len(layout.positions) for layout in plan.rank_layouts]
    assert plan.layout.local_lengths == (T,) * P
    assert counts[plan.rank] == max(counts) and counts.index(max(counts)) == plan.rank
    zigzag = layout_role_plans("document_zigzag", "lognormal", T, P)["middle"][0]
    assert counts[plan.rank] < len(zigzag.rank_layouts[zigzag.rank].positions)
    # one sequence: the balanced placement is zigzag, with its roles
    assert list(layout_role_plans("balanced_documents", "one_sequence", T, P)) == ["ends", "middle", "turn"]


def test_cli_runs_the_balanced_placement(one_thread, tmp_path):
    assert main(["bench", "--suite", "overhead", "--device", "cpu", "--seq-lens", "64", "--heads", "1", "--head-dim",
                 "8", "--batches", "lognormal", "--layouts", "balanced_documents", "--ranks", "3", "--out",
                 str(tmp_path)]) == 0
    rows = _by(json.loads((tmp_path / "overhead.json").read_text())["rows"], "overhead")
    assert {(r["layout"], r["P"], r["role"]) for r in rows} == {("balanced_documents", 3, "busiest")}
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in rows)


def test_every_asked_layout_is_planned():
    """With both zigzag layouts asked for, each batch runs one of them, and every other layout runs every batch."""
    from kdacp.bench.overhead import _cases
    batches = ("one_sequence", "docs7")
    layouts = ("contiguous", "zigzag", "document_zigzag", "balanced_documents")
    planned = {(batch, layout) for batch, layout, _, _ in _cases(batches, layouts, (2,), 64)}
    assert planned == {("one_sequence", "contiguous"), ("docs7", "contiguous"), ("one_sequence", "zigzag"),
                       ("docs7", "document_zigzag"), ("one_sequence", "balanced_documents"),
                       ("docs7", "balanced_documents")}
