"""The shared round-robin timing columns, on CPU in one process."""
import math

import torch

from kdacp.bench.timing import timed_columns


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
