"""``examples/train_fsdp.py`` under ``torchrun --nproc-per-node 4`` on CPU (gloo): 2 (dp) x 2 (cp), a few
FSDP2 steps of a tiny Kimi Linear with the model's own loss; every step's loss printed and finite."""
from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import pytest
import transformers  # noqa: F401  (in the `test` extra: a missing install fails here, not skips)

from kdacp.workers import free_port
from tests.multiprocess import run_command

ROOT = Path(__file__).resolve().parents[2]


# slow (28 s on 2 cores): FSDP2 with parallelize on the dp x cp mesh is checked in the default run by
# tests/models/test_training_stack.py, and launching under torchrun by tests/test_demo_end_to_end.py
@pytest.mark.slow
def test_train_fsdp_example_under_torchrun():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                       f"--master-port={free_port()}", str(ROOT / "examples" / "train_fsdp.py"), "--steps", "3",
                       "--tokens", "128"], 240, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 3 and all(math.isfinite(x) and 0 < x < 10 for x in losses), run.stdout
