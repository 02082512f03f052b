"""Row gathers and scatters by host indices with no device sync (:mod:`kdacp.host_copies`), and a rank of
several ranges indexing its states only through them: indexing a CUDA tensor with a Python list copies the
list from pageable memory, which makes the host wait for the device's whole queue."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from kdacp.bench.overhead import layout_role_plans
from kdacp.bench.rank_role import RankRole, StandInExchange
from kdacp.host_copies import host_boundaries, put_rows, take_rows
from kdacp.ops.kda import chunk_kda
from tests.helpers import ListIndexing, make_kda_inputs

ROWS = [(2, 3, 4), (0,), (4, 1, 3), (5, 0), (), (1, 2, 5)]


@pytest.mark.parametrize("rows", ROWS)
def test_take_and_put_rows_are_list_indexing(rows):
    t = torch.randn(6, 3, 2, generator=torch.Generator().manual_seed(len(rows)), dtype=torch.float64)
    taken = take_rows(t, rows)
    torch.testing.assert_close(taken, t[list(rows)], rtol=0, atol=0)
    if rows:  # a view exactly where rows are a slice
        consecutive = list(rows) == list(range(rows[0], rows[0] + len(rows)))
        assert (taken.data_ptr() == t[rows[0]].data_ptr()) == consecutive
    values = torch.randn(len(rows), 3, 2, dtype=torch.float64)
    expected = t.clone()
    expected[list(rows)] = values
    put_rows(t, rows, values)
    torch.testing.assert_close(t, expected, rtol=0, atol=0)


def test_the_detector_sees_list_indexing():
    t = torch.zeros(4)
    with ListIndexing() as mode:
        exec(compile("t[[0, 2]]", os.path.join("src", "kdacp", "cp", "probe.py"), "exec"), {"t": t})
    assert len(mode.found) == 1


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo group of this process alone: the final states' sum over ranks runs, adding nothing."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("role", ["ends", "middle", "turn"])
def test_a_rank_of_several_ranges_indexes_no_state_by_a_host_list(role, one_process_group):
    """Every role of a 3-rank per-document zigzag over 7 documents (several ranges a rank, affine and constant
    messages), with initial and final states: forward and backward index states by slices or device indices."""
    plan, _ = layout_role_plans("document_zigzag", "docs7", 96, 3)[role]
    x = make_kda_inputs(1, 96, 2, 2, 16, 16, gate="plain", requires_grad=False, seed=5)
    h0 = torch.randn(plan.num_sequences, 2, 16, 16, dtype=torch.float64)
    names = ("q", "k", "v", "g", "beta")
    with ListIndexing() as mode:
        call = RankRole.prepare(plan, **{n: x[n] for n in names}, backend="torch", initial_state=h0,
                                output_final_state=True)
        out = call.forward(StandInExchange())
        call.backward(out, torch.randn_like(out.o), torch.randn_like(out.final_state), exchange=StandInExchange())
    assert len(plan.rank_layouts[plan.rank].positions) > 1
    assert mode.found == []


@pytest.mark.gpu
@pytest.mark.parametrize("layout, batch", [("zigzag", "one_sequence"), ("document_zigzag", "docs7")])
def test_a_rank_of_several_ranges_queues_its_step_without_a_host_sync(layout, batch):
    """The same on FLA's kernels, seen by CUDA itself: after a warm-up step (memos filled), rank 0's forward and
    backward under a zigzag layout run with ``torch.cuda.set_sync_debug_mode("error")``."""
    from kdacp.backends.fla_adapter import fla_available
    from kdacp.bench.overhead import rank_step, role_call
    if not torch.cuda.is_available() or not fla_available():
        pytest.skip("needs a CUDA device and fla-core")
    device = torch.device("cuda")
    plan, _ = layout_role_plans(layout, batch, 4096, 3)["ends"]
    call, do = role_call("kda", "fla", 4096, 4, 128, torch.bfloat16, device)
    forward, backward = rank_step(call.backend, plan, call, do, None, StandInExchange())  # one forward inside
    backward()  # the warm-up fills the memos (boundaries, index tensors, summary plans)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward()
        backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_boundaries_are_read_to_the_host_once_per_tensor(monkeypatch):
    """The op called again with the same ``cu_seqlens`` (as every layer of a step calls it) reads it on the host
    no more: on a GPU each read is a device sync that stops the host queueing ahead. A new tensor, or the same one
    changed in place, is read afresh, and the results stay the op's."""
    cu = torch.tensor([0, 5, 17, 40])
    reads = []
    tolist = torch.Tensor.tolist

    def counted(self):
        if self is cu:
            reads.append(1)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    x = make_kda_inputs(1, 40, 2, 2, 8, 8, cu_seqlens=cu, requires_grad=False, seed=4)
    first = chunk_kda(**x, backend="torch")[0]
    assert len(reads) == 1
    for _ in range(3):
        torch.testing.assert_close(chunk_kda(**x, backend="torch")[0], first, rtol=0, atol=0)
    assert len(reads) == 1
    cu[2] = 20  # in place: other boundaries, read again
    assert host_boundaries(cu) == (0, 5, 20, 40) and len(reads) == 2
    assert host_boundaries(torch.tensor([0, 5, 20, 40])) == (0, 5, 20, 40)


def test_a_span_s_host_boundaries_are_one_tensor_across_calls():
    """A span's boundaries reach the host-reading launchers as one CPU tensor per distinct boundaries (host_tensor), so
    the memo of host reads keeps one entry for them instead of a new one a call (which pushed a batch's device
    boundaries out of it)."""
    from kdacp.backends.base import Span
    from kdacp.host_copies import _read_once, host_boundaries
    span = Span(0, 96, (0, 40, 96))
    first = span.cu_seqlens_host()
    assert first is Span(0, 96, (0, 40, 96)).cu_seqlens_host() and first.tolist() == [0, 40, 96]
    assert first.dtype == torch.int64 and first.device.type == "cpu"
    assert Span(0, 96, (0, 96)).cu_seqlens_host() is None
    before = _read_once.cache_info().currsize
    for _ in range(5):
        assert host_boundaries(Span(0, 96, (0, 40, 96)).cu_seqlens_host()) == (0, 40, 96)
    assert _read_once.cache_info().currsize <= before + 1


def test_row_taker_takes_what_take_rows_takes():
    """``row_taker(t)(rows)`` is ``take_rows(t, rows)``: one row a view of ``t`` (of a transposed ``t`` too), several
    rows gathered, the same values either way."""
    from kdacp.host_copies import row_taker, take_rows
    t = torch.randn(6, 2, 3, 4)
    for base in (t, t.transpose(-1, -2)):
        take = row_taker(base)
        for rows in ([0], [5], [1, 2], [4, 1, 3]):
            got = take(rows)
            assert torch.equal(got, take_rows(base, rows)) and got.shape == (len(rows), *base.shape[1:])
        assert take([2])._base is t


def test_a_device_tensor_made_inside_a_cuda_graph_capture_is_refused_by_name(monkeypatch):
    """A per-batch device tensor first made inside a capture (a cache miss there) is refused with what to do, before
    the pinned copy that would invalidate the capture; outside one, made as usual."""
    import kdacp.host_copies as host_copies
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self.clone())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture: run the captured call once"):
        host_copies.to_device(torch.arange(3), torch.device("cuda"))
    assert pinned == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert torch.equal(host_copies.to_device(torch.arange(3), torch.device("cuda")), torch.arange(3))
    assert len(pinned) == 1
