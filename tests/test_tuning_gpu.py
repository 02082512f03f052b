"""On a Hopper GPU, a first run at a head count kdacp's FLA configuration files lack (4 heads: tensor parallelism's
share of a 32-head layer) autotunes no kernel whose files hold a key equal but for its head counts: FLA takes the
nearest head count's configuration instead (:func:`kdacp.backends.fla_configs.lend_configs_across_heads`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from kdacp.backends.fla_configs import nearest_heads_entry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# In a fresh process (FLA reads its settings at import): KDA's op forward + backward at 4 heads, with every key
# Triton autotunes recorded (kernel, key names, the key as FLA files it); then the folder kdacp pointed FLA at.
_FIRST_RUN = """
import json, os, torch
from triton.runtime.autotuner import Autotuner
tuned = {}
bench = Autotuner._bench
def recording(self, *args, config, **meta):
    from fla.ops.utils.cache import AutotuneKey
    from kdacp.backends.fla_configs import autotune_key_names
    names = autotune_key_names(self, {**dict(zip(self.arg_names, args)), **meta})
    key = list(AutotuneKey.build(self.arg_names, self.keys, args, meta).autotune_key)
    tuned[json.dumps([getattr(self.fn, "fn", self.fn).__name__, names, key])] = True
    return bench(self, *args, config=config, **meta)
Autotuner._bench = recording
import kdacp
from kdacp.bench.inputs import random_inputs
x = random_inputs(4096, 4, 4, 128, 128, gate="kda", seed=1)
leaves = {n: x[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
o, _ = kdacp.chunk_kda(**leaves, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True,
                       lower_bound=-5.0, A_log=x["A_log"].float(), dt_bias=x["dt_bias"].float(), backend="fla")
o.backward(torch.randn_like(o))
torch.cuda.synchronize()
print(json.dumps({"tuned": [json.loads(t) for t in tuned], "dir": os.environ.get("FLA_CONFIG_DIR"),
                  "mode": os.environ.get("FLA_CACHE_MODE")}))
"""


def test_a_first_run_at_few_heads_autotunes_no_kernel_its_files_lend_to():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("kdacp ships FLA configurations for Hopper GPUs only")
    env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
    env["HOME"], env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(), tempfile.mkdtemp()  # no tuned files, no cache
    env.pop("XDG_CACHE_HOME", None)
    out = subprocess.run([sys.executable, "-c", _FIRST_RUN], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["mode"] == "strict" and run["dir"], run
    lent_yet_tuned = []
    for kernel, names, key in run["tuned"]:
        path = os.path.join(run["dir"], f"{kernel}.json")
        entries = json.loads(open(path).read())["autotune_entries"].values() if os.path.isfile(path) else []
        if nearest_heads_entry(names, key, entries) is not None:
            lent_yet_tuned.append((kernel, key))
    print(f"autotuned at 4 heads ({len(run['tuned'])} keys):", sorted({k for k, _, _ in run["tuned"]}))
    assert not lent_yet_tuned, f"autotuned though the files lend them a configuration: {lent_yet_tuned}"
