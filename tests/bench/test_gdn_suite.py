"""The gdn suite's device-time columns (the suite itself runs FLA's CUDA kernels: GPU only), on the CPU's wall
clock with stand-in steps."""
from __future__ import annotations

import math
import time

import torch

from kdacp.bench.gdn import device_columns


def test_device_columns_time_both_ops_and_take_their_ratio():
    fns = {"fla": lambda: time.sleep(0.002), "kdacp": lambda: time.sleep(0.004), "kdacp_cp1": lambda: 1 / 0}
    failures = []
    cols = device_columns(fns, 1, 2, 2, failures.append, device=torch.device("cpu"))
    assert not failures and set(cols) == {"fla_device_ms", "kdacp_device_ms", "kdacp_device_ratio"}
    assert 2.0 <= cols["fla_device_ms"] < cols["kdacp_device_ms"]  # the other contenders are not timed
    assert math.isclose(cols["kdacp_device_ratio"], cols["kdacp_device_ms"] / cols["fla_device_ms"])


def test_device_columns_report_a_failure_as_nan():
    failures = []
    cols = device_columns({"fla": lambda: None, "kdacp": lambda: 1 / 0}, 1, 1, 1, failures.append,
                          device=torch.device("cpu"))
    assert len(failures) == 1 and "ZeroDivisionError" in failures[0]
    assert all(math.isnan(v) for v in cols.values())
