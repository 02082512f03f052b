"""The shared round-robin timing columns, on CPU in one process."""
import math
import time

import pytest
import torch

from kdacp.bench.timing import host_and_wall_times, queue_ahead_for, queued_device_time, time_queued, timed_columns
from tests.helpers import fake_cuda_clock


def test_timed_columns_ratios_and_missing_names():
    cols = timed_columns({"a": lambda: None, "b": lambda: sum(range(20000))}, ("a", "b", "c"), "b", 1, 2, 3, None,
                         torch.device("cpu"), on_failure=lambda tb: None)
    assert cols["b_ratio"] == 1.0 and cols["a_ms"] > 0 and cols["a_ratio"] == cols["a_ms"] / cols["b_ms"]
    assert math.isnan(cols["c_ms"]) and math.isnan(cols["c_ratio"])


def test_timed_columns_failure_is_reported_and_nan():
    failures = []

    def boom():
        raise RuntimeError("kernel failed")
    cols = timed_columns({"a": lambda: None, "b": boom}, ("a", "b"), "a", 1, 1, 1, None, torch.device("cpu"),
                         on_failure=failures.append)
    assert len(failures) == 1 and "kernel failed" in failures[0]
    assert all(math.isnan(v) for v in cols.values())


def test_timed_columns_queued_name_device_columns():
    # queued behind a device sleep (wall clock on the CPU): the gdn suite's device-time columns
    cols = timed_columns({"fla": lambda: time.sleep(0.002), "kdacp": lambda: time.sleep(0.004)}, ("fla", "kdacp"),
                         "fla", 1, 2, 2, None, torch.device("cpu"), on_failure=lambda tb: None, queued=True)
    assert set(cols) == {"fla_device_ms", "kdacp_device_ms", "fla_device_ratio", "kdacp_device_ratio"}
    assert 2.0 <= cols["fla_device_ms"] < cols["kdacp_device_ms"]
    assert cols["kdacp_device_ratio"] == cols["kdacp_device_ms"] / cols["fla_device_ms"]
    failures = []
    cols = timed_columns({"fla": lambda: None, "kdacp": lambda: 1 / 0}, ("fla", "kdacp"), "fla", 1, 1, 1, None,
                         torch.device("cpu"), on_failure=failures.append, queued=True)
    assert len(failures) == 1 and "ZeroDivisionError" in failures[0]
    assert all(math.isnan(v) for v in cols.values())
    with pytest.raises(ValueError, match="queued timing runs in this process alone: pass group=None"):
        timed_columns({}, (), "fla", 1, 1, 1, object(), torch.device("cpu"), on_failure=None, queued=True)


def _work(clock, seconds, host_sync=False):
    def call():
        clock["queued"] += seconds  # the call's device work, queued
        if host_sync:
            torch.cuda.synchronize()
    return call


@pytest.mark.parametrize("host_sync", [False, True])
def test_queued_timing_is_device_time_and_refuses_a_device_that_caught_up(monkeypatch, host_sync):
    """The GPU branch on a fake device clock: calls queued behind the sleep are timed by their device
    work alone; a call that syncs the host lets the device start before all are queued: refused."""
    clock = fake_cuda_clock(monkeypatch)
    fns = {"a": _work(clock, 0.002, host_sync), "b": _work(clock, 0.005)}
    if host_sync:
        with pytest.raises(RuntimeError, match="before the host had queued"):
            time_queued(fns, 1, 2, 3, torch.device("cuda"))
    else:
        assert time_queued(fns, 1, 2, 3, torch.device("cuda")) == pytest.approx({"a": 2.0, "b": 5.0})


def test_queue_ahead_covers_four_times_the_slowest_calls(monkeypatch):
    fake_cuda_clock(monkeypatch)
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def host(seconds):
        return lambda: now.__setitem__(0, now[0] + seconds)
    assert queue_ahead_for([host(0.001), host(0.003)], 5, torch.device("cuda")) == pytest.approx(60.0)
    assert queue_ahead_for([host(1.0)], 5, torch.device("cuda")) == 2000.0  # capped
    assert queue_ahead_for([host(1.0)], 5, torch.device("cpu")) == 0.0


@pytest.mark.parametrize("host_sync", [False, True])
def test_queued_device_time_is_device_time_and_refuses_a_device_that_caught_up(monkeypatch, host_sync):
    clock = fake_cuda_clock(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    call = _work(clock, 0.004, host_sync)
    if host_sync:
        with pytest.raises(RuntimeError, match="before the host had queued"):
            queued_device_time(call, iters=5, warmup=1)
    else:
        assert queued_device_time(call, iters=5, warmup=1)[0] == pytest.approx(0.004)


def test_host_and_wall_times_per_call():
    """A call that keeps the host 2 ms: about 2 ms of host time per call, and the wall time no less."""
    host, wall = host_and_wall_times(lambda: time.sleep(2e-3), 5, torch.device("cpu"))
    assert 2e-3 <= host < 0.05 and wall >= host


def test_rel_err_is_the_relative_two_norm_in_the_dtype_asked():
    from kdacp.bench.errors import rel_err
    b = torch.tensor([3.0, 4.0])
    assert rel_err(b + torch.tensor([0.0, 0.5]), b) == pytest.approx(0.1)
    assert rel_err(torch.ones(2), torch.zeros(2)) == pytest.approx(2 ** 0.5 * 1e30)  # a zero reference: 1e-30
    one_ulp = torch.tensor([1.0 + 2 ** -40], dtype=torch.float64)
    assert rel_err(one_ulp, torch.ones(1, dtype=torch.float64)) > 0
    assert rel_err(one_ulp, torch.ones(1, dtype=torch.float64), torch.float32) == 0  # rounded in float32
