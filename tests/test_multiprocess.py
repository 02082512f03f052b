"""The tests' own process helpers: a launcher run past its deadline leaves no process behind."""
from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from tests.multiprocess import run_command


def _running(marker: str) -> list[str]:
    return [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
            if marker in line]


def test_a_command_past_its_deadline_is_killed_with_its_children():
    marker = f"kdacp-test-{uuid.uuid4().hex}"
    # a launcher whose child outlives it unless its whole process group is killed
    script = f"exec -a {marker} sleep 60 & wait"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still running after 1 s"):
        run_command(["bash", "-c", script], 1.0)
    # promptly: a surviving child would hold the output pipes open (and the call with them) for its 60 s
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 5
    while _running(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(marker) == []


def test_a_command_within_its_deadline_returns_its_output():
    done = run_command(["bash", "-c", "echo out; echo err >&2; exit 3"], 30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
