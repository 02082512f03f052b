"""The stage probe's stamps: where a role posts its message, blocks and goes on, as stage times.

CPU: the clock around known work. GPU (`gpu` marker): device time of known device work queued
behind the probe's sleep, however slow the host is meanwhile; a host sync inside the call is refused."""
from __future__ import annotations

import time

import pytest
import torch

from kdacp.bench.stage_probe import StageProbe
from kdacp.cp.exchanges import Route

from tests.helpers import fake_cuda_clock


def _route(device) -> Route:
    # a middle rank of three: it receives and sends
    return Route(1, None, (0, 1, 2), (1, 1, 0), (False, True, False), (1, 1, 2, 2), torch.float32, device)


def _call(probe: StageProbe, wait, parts_s) -> torch.Tensor:
    """Work of ``parts_s[0]`` before the send, ``[1]`` until the receive, ``[2]`` after it; returns what
    the probe handed back at the receive (read it after ``probe.finish()``: reading it syncs the host)."""
    pending = probe.begin(_route(probe.device))
    wait(parts_s[0])
    probe.send(pending, [None])
    wait(parts_s[1])
    (incoming,) = probe.receive(pending)
    wait(parts_s[2])
    return incoming


def test_cpu_stages_are_the_clock_between_the_stamps(monkeypatch):
    clock = [100.0]  # a clock that moves only when the work "runs"
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    probe = StageProbe(torch.device("cpu"))
    probe.start()

    def work(seconds):
        clock[0] += seconds
    incoming = _call(probe, work, (0.02, 0.04, 0.03))
    stages = probe.finish()
    assert (stages.ready, stages.between, stages.after) == pytest.approx((0.02, 0.04, 0.03))
    assert incoming is not None and not incoming.any()


@pytest.mark.parametrize("host_sync", [False, True])
def test_gpu_branch_on_fake_events(monkeypatch, host_sync):
    """The GPU branch's bookkeeping without a GPU: events read a fake device clock; the device stays
    asleep until the call is queued unless the host syncs inside it."""
    clock = fake_cuda_clock(monkeypatch)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: torch.ones(1).new_zeros(a[0]))
    probe = StageProbe(torch.device("cuda"), queue_ahead_s=0.01)
    probe.start()

    def work(seconds):
        clock["queued"] += seconds
        if host_sync:
            torch.cuda.synchronize()
    _call(probe, work, (0.002, 0.004, 0.001))
    if host_sync:
        with pytest.raises(RuntimeError, match="host sync"):
            probe.finish()
    else:
        stages = probe.finish()
        assert (stages.ready, stages.between, stages.after) == pytest.approx((0.002, 0.004, 0.001))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _device_wait(seconds: float) -> None:
    torch.cuda._sleep(int(seconds * 2e9))
    time.sleep(0.002)  # a slow host between launches: not device time


@pytest.mark.gpu
@gpu
def test_gpu_stages_are_device_time_of_the_queued_call():
    # a warm-up call first, as the suites make (a kernel's first launch loads its module, which may sync);
    # then the sleep covers the host's 6 ms of launches and waits, so the device runs the call queued
    warm = StageProbe(torch.device("cuda"))
    warm.start()
    _call(warm, _device_wait, (0.0, 0.0, 0.0))
    warm.finish()
    probe = StageProbe(torch.device("cuda"), queue_ahead_s=0.1)
    probe.start()
    incoming = _call(probe, _device_wait, (0.002, 0.004, 0.001))
    stages = probe.finish()
    assert incoming is not None and not incoming.any()
    # the host's 2 ms between launches would double the last stage were it counted
    for got, want in zip((stages.ready, stages.between, stages.after), (0.002, 0.004, 0.001)):
        assert 0.7 * want < got < 1.4 * want, stages


@pytest.mark.gpu
@gpu
def test_gpu_probe_refuses_a_call_with_a_host_sync():
    probe = StageProbe(torch.device("cuda"), queue_ahead_s=0.01)
    probe.start()
    _call(probe, lambda s: torch.cuda.synchronize(), (0, 0, 0))
    with pytest.raises(RuntimeError, match="host sync"):
        probe.finish()
