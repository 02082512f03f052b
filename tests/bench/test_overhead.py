"""``kdacp bench --suite overhead`` on the CPU (torch backend, tiny sizes): the table's shape, ratios
positive and finite, and each role's extra work in the breakdown (the through rank's ``M`` and ``G``;
a packed rank's split spans)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kdacp.bench.overhead import markdown, run
from kdacp.cli import main

TINY = ["--device", "cpu", "--seq-lens", "64", "--heads", "1", "--head-dim", "8"]


@pytest.fixture
def one_thread():
    """One intra-op thread: on a busy 2-core machine, a pool of spinning threads makes tiny ops slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _by(rows: list[dict], source: str) -> list[dict]:
    return [r for r in rows if r["source"] == source]


def _stages(rows: list[dict], role: str) -> dict:
    return {r["stage"]: r for r in _by(rows, "breakdown") if r["role"] == role}


def _check_ratios(rows: list[dict]) -> None:
    overhead = _by(rows, "overhead")
    assert [r["role"] for r in overhead] == ["first", "through", "last"]
    assert all(r["backend"] == "torch" for r in overhead)  # the CPU check's backend, named in every row
    for r in overhead:
        for name in ("rank_fwd_ms", "rank_bwd_ms", "one_fwd_ms", "one_bwd_ms", "fwd_ratio", "bwd_ratio", "ratio"):
            assert math.isfinite(r[name]) and r[name] > 0, (name, r)
    stages = {(r["role"], r["direction"]): r for r in _by(rows, "stages")}
    assert len(stages) == 6 and all(r[f"{n}_ms"] >= 0 for r in stages.values() for n in ("ready", "between", "after"))
    # the first rank receives nothing forward, the last nothing backward: no work after the (empty) wait
    assert stages["first", "forward"]["after_ms"] < stages["first", "forward"]["ready_ms"]


def test_one_sequence_kda_through_rank_runs_the_summaries(one_thread, tmp_path, capsys):
    rc = main(["bench", "--suite", "overhead", *TINY, "--family", "kda", "--batches", "one_sequence",
               "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    overhead = _by(rows, "overhead")
    _check_ratios(rows)
    assert [(r["receives"], r["sends"], r["affine"]) for r in overhead] == [(0, 1, False), (1, 1, True), (1, 0, False)]
    # the through rank alone runs S_ext + M forward, G backward, and M x + S in both directions
    through = _stages(rows, "through")
    for stage, calls in (("state_summary", 1), ("state_gradient_summary", 1), ("apply", 2)):
        assert through[stage]["calls"] == calls and through[stage]["one_calls"] == 0, through[stage]
        assert through[stage]["extra_ms"] == through[stage]["ms"] > 0
    for role in ("first", "last"):
        stages = _stages(rows, role)
        assert not {"state_summary", "state_gradient_summary", "apply"} & set(stages), stages
        # one sequence: the same stages as one device, each once
        assert all(r["calls"] == r["one_calls"] == 1 for r in stages.values()), stages
    out = capsys.readouterr().out
    assert "### per-rank overhead" in out and "### critical-path stages" in out
    assert "| kda | one_sequence | contiguous | 3 | through | state_summary | 1 |" in out


def test_packed_gdn_roles_split_their_spans(one_thread):
    rows = run(t_local=64, families=("gdn",), batches=("lognormal",), heads=2, head_dim=8, device="cpu")
    overhead = _by(rows, "overhead")
    _check_ratios(rows)
    assert all(r["family"] == "gdn" and r["batch"] == "lognormal" for r in rows)
    # documents cut at both edges: the middle rank receives and sends, but holds more than one chain
    assert [(r["receives"], r["sends"], r["affine"]) for r in overhead] == [(0, 1, False), (1, 1, False), (1, 0, False)]
    # a rank with a head and a tail splits its forward (the rest's pass makes the message, the head waits) and
    # runs its head's gradient pass for the message besides the whole one; the others launch as one device does
    for role in ("first", "last"):
        assert all(r["calls"] == r["one_calls"] == 1 for r in _stages(rows, role).values()), _stages(rows, role)
    through = _stages(rows, "through")
    for split in ("state_pass", "output", "backward_states"):
        assert (through[split]["calls"], through[split]["one_calls"]) == (2, 1), through[split]
    assert "state_summary" not in through and through["backward_inputs"]["calls"] == 1
    assert "| gdn | lognormal | contiguous | 3 | through | state_pass | 2 |" in markdown(rows)


def test_usage_errors(tmp_path, capsys):
    assert main(["bench", "--suite", "overhead", *TINY, "--seq-lens", "64,128", "--out", str(tmp_path)]) == 2
    assert "takes one --seq-lens value" in capsys.readouterr().err
    assert main(["bench", "--suite", "overhead", *TINY, "--world-size", "2", "--out", str(tmp_path)]) == 2
    assert "--world-size is for" in capsys.readouterr().err
    with pytest.raises(ValueError, match="families must be from"):
        run(families=("gla",), device="cpu")


@pytest.mark.parametrize("host_sync", [False, True])
def test_breakdown_gpu_branch_queues_each_round_and_refuses_a_host_sync(monkeypatch, one_thread, host_sync):
    """The breakdown's GPU branch on a fake device clock (the stages run on the CPU meanwhile): each round
    is queued behind a sleep; a stage that syncs the host lets the device catch up, which is refused."""
    from kdacp.bench.overhead import _breakdown, role_call, role_plans
    from tests.helpers import fake_cuda_clock

    call, do = role_call("kda", "torch", 64, 1, 8, torch.float32, torch.device("cpu"))
    fake_cuda_clock(monkeypatch)
    if host_sync:
        inner = call.backend.state_pass

        def syncing(*args, **kwargs):
            torch.cuda.synchronize()
            return inner(*args, **kwargs)
        monkeypatch.setattr(call.backend, "state_pass", syncing)
    plans = role_plans("one_sequence", 64)
    with torch.no_grad():
        if host_sync:
            with pytest.raises(RuntimeError, match="before the host had queued"):
                _breakdown(call, do, torch.float32, plans, torch.device("cuda"), warmup=True, rounds=1)
        else:
            got = _breakdown(call, do, torch.float32, plans, torch.device("cuda"), warmup=True, rounds=2)
            assert {"state_summary", "state_gradient_summary", "apply"} <= set(got["through"])
            assert "state_summary" not in got[("one", "through")]


def test_rounds_and_iters_reach_the_suite(monkeypatch, tmp_path, capsys):
    """``--rounds`` / ``--iters`` become the overhead suite's ``rounds`` / ``iters``; another suite refuses them."""
    import kdacp.bench.overhead as overhead
    seen = {}

    def fake_run(**kwargs):
        seen.update(kwargs)
        return []
    monkeypatch.setattr(overhead, "run", fake_run)
    assert main(["bench", "--suite", "overhead", *TINY, "--family", "kda", "--rounds", "4", "--iters", "3",
                 "--out", str(tmp_path)]) == 0
    assert (seen["rounds"], seen["iters"]) == (4, 3), seen
    assert main(["bench", "--suite", "kernels", "--rounds", "4", "--out", str(tmp_path)]) == 2
    assert "--rounds is for --suite overhead or layer" in capsys.readouterr().err
