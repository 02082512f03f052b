"""Shipped FLA kernel configurations: the export from a Triton autotune cache, the files shipped, and
when kdacp points FLA at them."""
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

from kdacp.backends import fla_configs
from kdacp.backends.fla_configs import (SHIPPED_CONFIGS, choose_config_dir, export_fla_configs, fla_key_hash,
                                        gpu_dir_name, use_configs_for_this_gpu, use_shipped_configs)


def _config(bt, warps):
    return {"kwargs": {"BT": bt}, "num_warps": warps, "num_ctas": 1, "num_stages": 3, "maxnreg": None,
            "pre_hook": None, "ir_override": None}


def test_export_picks_the_fastest_config_per_key(tmp_path):
    cache = tmp_path / "triton"
    for h, key, timings in (("A", [128, True, "torch.bfloat16"], [[_config(16, 4), [2.0, 2.2]], [_config(32, 8), [1.0, 1.1]]]),
                            ("B", [64, False, "torch.float32"], [[_config(64, 4), [0.5]]])):
        (cache / h).mkdir(parents=True)
        (cache / h / "my_kernel.autotune.json").write_text(json.dumps({"key": key, "configs_timings": timings}))
    (cache / "C").mkdir()
    (cache / "C" / "other_kernel.autotune.json").write_text(json.dumps({"key": [1], "configs_timings": [[_config(1, 1), [1.0]]]}))
    out = tmp_path / "out"
    paths = export_fla_configs(cache, out, kernels={"my_kernel"}, triton_version="3.6.0")
    assert [p.name for p in paths] == ["my_kernel.json"]
    data = json.loads(paths[0].read_text())
    assert data["kernel_name"] == "my_kernel" and data["triton_version"] == "3.6.0"
    entry = data["autotune_entries"][fla_key_hash([128, True, "torch.bfloat16"])]
    assert entry["config"]["kwargs"] == {"BT": 32} and entry["config"]["num_warps"] == 8
    assert len(data["autotune_entries"]) == 2
    # FLA files an entry under md5 of its key as compact, key-sorted JSON (fla.ops.utils.cache.AutotuneKey)
    assert fla_key_hash([128, True, "torch.bfloat16"]) == hashlib.md5(b'[128,true,"torch.bfloat16"]').hexdigest()


@pytest.mark.parametrize("gpu", ["NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"])
def test_shipped_files_are_consistent(gpu):
    """Each shipped GPU's folder holds FLA's files, each entry under its key's hash, and is named in
    SHIPPED_CAPABILITY (which lends it to the GPUs of its capability without files of their own)."""
    assert sorted(d.name for d in SHIPPED_CONFIGS.iterdir() if d.is_dir()) == sorted(fla_configs.SHIPPED_CAPABILITY)
    files = sorted((SHIPPED_CONFIGS / gpu).glob("*.json"))
    assert len(files) >= 10
    for path in files:
        data = json.loads(path.read_text())
        assert data["kernel_name"] == path.stem and data["autotune_entries"]
        for h, entry in data["autotune_entries"].items():
            assert fla_key_hash(entry["autotune_key"]) == h, path.name
            assert {"kwargs", "num_warps", "num_stages", "num_ctas"} <= entry["config"].keys(), path.name


def test_use_shipped_configs_never_overrides_the_user():
    env = {}
    assert use_shipped_configs("NVIDIA H200", env) == SHIPPED_CONFIGS / "NVIDIA_H200"
    assert env == {"FLA_CONFIG_DIR": str(SHIPPED_CONFIGS / "NVIDIA_H200"), "FLA_CACHE_MODE": "strict"}
    for user in ({"FLA_CACHE_MODE": "disabled"}, {"FLA_CONFIG_DIR": "/mine"}):
        env = dict(user)
        assert use_shipped_configs("NVIDIA H200", env) is None and env == user
    env = {}
    assert use_shipped_configs("Some Other GPU", env) is None and env == {}
    assert use_shipped_configs(None, env) is None and gpu_dir_name("NVIDIA H200") == "NVIDIA_H200"


def test_a_users_own_configurations_come_first(tmp_path):
    (tmp_path / "NVIDIA_H200").mkdir()
    env = {}
    assert use_shipped_configs("NVIDIA H200", env, user_dir=tmp_path) == tmp_path / "NVIDIA_H200"
    assert env["FLA_CONFIG_DIR"] == str(tmp_path / "NVIDIA_H200")
    env = {}
    assert use_shipped_configs("NVIDIA H200", env, user_dir=tmp_path / "none") == SHIPPED_CONFIGS / "NVIDIA_H200"


def _fake_gpu(monkeypatch, tmp_path, name, capability, shipped=("NVIDIA_H200",)):
    """A CUDA device named ``name`` of ``capability``, with kdacp shipping files for the GPUs ``shipped``
    only (all sm_90) and no files of the user's."""
    import torch

    for gpu in shipped:
        (tmp_path / "shipped" / gpu).mkdir(parents=True)
    monkeypatch.setattr(fla_configs, "SHIPPED_CONFIGS", tmp_path / "shipped")
    monkeypatch.setattr(fla_configs, "SHIPPED_CAPABILITY", {gpu: (9, 0) for gpu in shipped})
    monkeypatch.setattr(fla_configs, "USER_CONFIGS", tmp_path / "user")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    return tmp_path / "shipped"


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H800"])
def test_a_hopper_gpu_without_files_of_its_own_takes_the_h200s(monkeypatch, tmp_path, caplog, name):
    """An H100 of any variant with no files of its own takes the H200's (both sm_90) instead of
    autotuning every kernel shape of a first run (minutes), and says so in one line naming both GPUs
    and how to make its own."""
    shipped = _fake_gpu(monkeypatch, tmp_path, name, (9, 0))
    env = {}
    with caplog.at_level("WARNING"):
        assert use_configs_for_this_gpu(env) == shipped / "NVIDIA_H200"
    assert env == {"FLA_CONFIG_DIR": str(shipped / "NVIDIA_H200"), "FLA_CACHE_MODE": "strict"}
    assert len(caplog.messages) == 1
    note = caplog.messages[0]
    assert "\n" not in note and name in note and "NVIDIA H200 (same architecture, sm_90)" in note
    assert "`kdacp tune`" in note and str(tmp_path / "user" / gpu_dir_name(name)) in note


def test_the_nearest_sibling_is_the_one_sharing_most_of_the_name(monkeypatch, tmp_path):
    shipped = _fake_gpu(monkeypatch, tmp_path, "unused", (9, 0), shipped=("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"))
    assert choose_config_dir("NVIDIA H100 PCIe", (9, 0)) == shipped / "NVIDIA_H100_80GB_HBM3"
    assert choose_config_dir("NVIDIA H200 NVL", (9, 0)) == shipped / "NVIDIA_H200"
    assert choose_config_dir("NVIDIA H800", (9, 0)) == shipped / "NVIDIA_H100_80GB_HBM3"  # a tie: the first by name
    assert choose_config_dir("NVIDIA H200", (9, 0)) == shipped / "NVIDIA_H200"  # its own
    assert choose_config_dir("NVIDIA H100 PCIe") is None  # no capability, no sibling


def test_a_gpu_of_another_architecture_takes_no_siblings_files(monkeypatch, tmp_path, caplog):
    _fake_gpu(monkeypatch, tmp_path, "NVIDIA A100-SXM4-80GB", (8, 0))
    env = {}
    with caplog.at_level("WARNING"):
        assert use_configs_for_this_gpu(env) is None
    assert env == {} and len(caplog.messages) == 1
    assert "A100" in caplog.messages[0] and "autotunes" in caplog.messages[0] and "`kdacp tune`" in caplog.messages[0]


@pytest.mark.parametrize("env", [{"FLA_CACHE_MODE": "disabled"}, {"FLA_CONFIG_DIR": "/mine"}, {"LOCAL_RANK": "1"}])
def test_no_note_where_the_user_chose_or_on_other_ranks(monkeypatch, tmp_path, caplog, env):
    _fake_gpu(monkeypatch, tmp_path, "NVIDIA H100 PCIe", (9, 0))
    with caplog.at_level("WARNING"):
        used = use_configs_for_this_gpu(env)
    assert caplog.messages == []
    assert (used is not None) == ("LOCAL_RANK" in env)  # the other ranks still take the H200's, quietly


def test_no_note_for_a_gpu_with_files_of_its_own(monkeypatch, tmp_path, caplog):
    shipped = _fake_gpu(monkeypatch, tmp_path, "NVIDIA H200", (9, 0))
    with caplog.at_level("WARNING"):
        assert use_configs_for_this_gpu({}) == shipped / "NVIDIA_H200"
    assert caplog.messages == []


def test_every_shipped_folder_names_its_architecture():
    from kdacp.backends.fla_configs import SHIPPED_CAPABILITY
    assert {d.name for d in SHIPPED_CONFIGS.iterdir() if d.is_dir()} == SHIPPED_CAPABILITY.keys()


def _entries(*pairs):
    """A configuration file's entries: (key, BT) pairs."""
    return {fla_key_hash(key): {"autotune_key": key, "config": _config(bt, 4)} for key, bt in pairs}


def _write(folder, kernel, entries):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{kernel}.json").write_text(json.dumps({"kernel_name": kernel, "triton_version": "3.6.0",
                                                       "autotune_entries": entries}))


def _read(folder, kernel):
    return {tuple(e["autotune_key"]): e["config"]["kwargs"]["BT"]
            for e in json.loads((folder / f"{kernel}.json").read_text())["autotune_entries"].values()}


def test_add_missing_entries_keeps_the_folders_own(tmp_path):
    from kdacp.backends.fla_configs import add_missing_entries
    base, out = tmp_path / "base", tmp_path / "out"
    _write(base, "a_kernel", _entries(([64], 16), ([128], 16)))
    _write(base, "b_kernel", _entries(([1], 32)))
    _write(out, "a_kernel", _entries(([64], 64)))
    assert add_missing_entries(out, base) == [out / "a_kernel.json", out / "b_kernel.json"]
    assert _read(out, "a_kernel") == {(64,): 64, (128,): 16}  # its own entry kept, the missing one added
    assert _read(out, "b_kernel") == {(1,): 32}
    assert add_missing_entries(out, base) == []  # nothing lacks now


def test_tune_keeps_every_shape_the_configurations_used_before_served(monkeypatch, tmp_path):
    """An H100 without files of its own ran on the H200's; after `kdacp tune` at one shape it runs on its
    own folder alone, which must still hold the H200's entries for the shapes it did not tune (else those
    would autotune again, minutes), its tuned entries winning."""
    import kdacp.tuning
    shipped = _fake_gpu(monkeypatch, tmp_path, "NVIDIA H100 80GB HBM3", (9, 0))
    _write(shipped / "NVIDIA_H200", "a_kernel", _entries(([64], 16), ([128], 16)))
    _write(shipped / "NVIDIA_H200", "b_kernel", _entries(([1], 32)))

    def tune_into(cache, out, *args):  # FLA's export of the one shape tuned
        _write(out, "a_kernel", _entries(([64], 64)))
        return [out / "a_kernel.json"]
    monkeypatch.setattr(kdacp.tuning, "_tune_into", tune_into)
    own = tmp_path / "user" / "NVIDIA_H100_80GB_HBM3"
    assert kdacp.tuning.tune() == [own / "a_kernel.json", own / "b_kernel.json"]
    assert _read(own, "a_kernel") == {(64,): 64, (128,): 16} and _read(own, "b_kernel") == {(1,): 32}
    assert choose_config_dir("NVIDIA H100 80GB HBM3", (9, 0)) == own  # used from now on
    _write(shipped / "NVIDIA_H200", "b_kernel", _entries(([1], 32), ([2], 8)))
    assert kdacp.tuning.tune() == [own / "a_kernel.json"]  # again: the folder used now is its own
    assert _read(own, "b_kernel") == {(1,): 32}


def _plain_autotuned_kernel():
    """A kernel shaped like FLA's gated norm: ``@triton.heuristics`` over Triton's plain ``@triton.autotune``."""
    import triton
    import triton.language as tl

    @triton.heuristics({"HAS_W": lambda args: args["w"] is not None})
    @triton.autotune(configs=[triton.Config({"BT": bt}, num_warps=w) for bt in (4, 8) for w in (1, 2)],
                     key=["D", "HAS_W"])
    @triton.jit
    def scale_rows(x, w, y, T, D: tl.constexpr, HAS_W: tl.constexpr, BT: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.arange(0, D)
        mask = (rows < T)[:, None]
        v = tl.load(x + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
        if HAS_W:
            v = v * tl.load(w + cols)[None, :]
        tl.store(y + rows[:, None] * D + cols[None, :], v * 2, mask=mask)
    return scale_rows


def test_seeded_plain_autotuner_runs_the_shipped_config_without_tuning(tmp_path):
    import torch
    import triton

    from kdacp.backends.fla_configs import seed_autotuner
    kernel = _plain_autotuned_kernel()
    autotuner = kernel.fn  # under the heuristics
    key = [16, True, "torch.float32", "torch.float32", "torch.float32"]  # D, HAS_W, then x, w, y dtypes
    other = [32, False, "torch.float32", "torch.float32"]
    autotuner.cache[tuple(other)] = triton.Config({"BT": 4}, num_warps=1)  # tuned already: kept
    (tmp_path / "scale_rows.json").write_text(json.dumps({"kernel_name": "scale_rows", "autotune_entries": {
        fla_key_hash(key): {"autotune_key": key, "config": _config(8, 2) | {"kwargs": {"BT": 8}}},
        fla_key_hash(other): {"autotune_key": other, "config": _config(8, 2) | {"kwargs": {"BT": 8}}}}}))
    assert seed_autotuner(autotuner, tmp_path / "absent") == 0
    assert seed_autotuner(autotuner, tmp_path) == 1
    seeded = autotuner.cache[tuple(key)]
    assert seeded.kwargs == {"BT": 8} and seeded.num_warps == 2
    assert autotuner.cache[tuple(other)].kwargs == {"BT": 4}

    def no_tuning(*args, **kwargs):
        raise AssertionError("the seeded key was autotuned")
    autotuner._bench = no_tuning
    x, w = torch.randn(20, 16), torch.randn(16)
    y = torch.empty_like(x)
    kernel[lambda meta: (triton.cdiv(20, meta["BT"]),)](x, w, y, 20, D=16)
    assert autotuner.best_config is seeded
    torch.testing.assert_close(y, 2 * x * w)


_IMPORTED_FIRST = """
import os, torch
from unittest import mock
import fla.ops.utils.cache as cache  # FLA imported before kdacp, as transformers' model modules do
assert cache.FLA_CACHE_MODE is cache.FlaCacheMode.DISABLED
if {no_reread}:
    import kdacp.backends.fla_adapter as adapter
    adapter._reread_cache_mode = lambda: None
with mock.patch.object(torch.cuda, "is_available", lambda: True), \\
        mock.patch.object(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200"), \\
        mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (9, 0)):
    from kdacp.backends.fla_adapter import fla_available
    assert fla_available()
print(cache.FLA_CACHE_MODE.value, os.path.basename(os.environ["FLA_CONFIG_DIR"]))
"""


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core importable")
@pytest.mark.parametrize("no_reread", [False, True], ids=["kdacp", "without the re-read"])
def test_shipped_configs_apply_when_fla_was_imported_first(no_reread):
    env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
    env["HOME"] = tempfile.mkdtemp()  # no user configurations from `kdacp tune`
    env.pop("XDG_CACHE_HOME", None)
    out = subprocess.run([sys.executable, "-c", _IMPORTED_FIRST.format(no_reread=no_reread)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    mode, folder = out.stdout.split()
    assert folder == "NVIDIA_H200"
    assert mode == ("disabled" if no_reread else "strict")  # without the re-read FLA ignores the shipped files


def test_shipped_state_pass_runs_sequence_lists_at_bv_64():
    """FLA keys its state pass's configuration on heads and dtypes, not on the sequence count, so an entry
    tuned on one sequence serves a rank's ranges too. On the H200 a 32-head pass over several sequences
    with incoming states is faster at BV = 64 (half the blocks, as many as one 16K sequence at BV = 32):
    measured in benchmarks/RESULTS.md (Per-rank overhead). A re-export that tunes this key on one sequence
    would bring BV = 32 back."""
    data = json.loads((SHIPPED_CONFIGS / "NVIDIA_H200" / "chunk_gated_delta_rule_fwd_kernel_h_blockdim64.json").read_text())
    bf16, f32, i64 = "torch.bfloat16", "torch.float32", "torch.int64"
    # H, HV, K, V, BT, STATE_V_FIRST; then k, v, w, v_new, gk, h, h0, cu_seqlens, chunk_offsets
    key = [32, 32, 128, 128, 64, False, bf16, bf16, bf16, bf16, f32, bf16, f32, i64, i64]
    assert data["autotune_entries"][fla_key_hash(key)]["config"]["kwargs"] == {"BV": 64}


def _entry(key, bv):
    return {"autotune_key": key, "config": _config(64, 4) | {"kwargs": {"BV": bv}}}


_NAMES = ["H", "HV", "K", "V", "BT", "STATE_V_FIRST"]  # FLA's state pass; its tensor dtypes follow
_BF16 = "torch.bfloat16"


def test_an_entry_is_lent_only_across_head_counts_to_the_nearest():
    from kdacp.backends.fla_configs import nearest_heads_entry
    at = {h: _entry([h, h, 128, 128, 64, False, _BF16], h) for h in (2, 8, 32)}
    key = [4, 4, 128, 128, 64, False, _BF16]
    assert nearest_heads_entry(_NAMES, key, at.values()) is at[8]  # 2x from both 2 and 8: more heads
    assert nearest_heads_entry(_NAMES, [24, 24, 128, 128, 64, False, _BF16], at.values()) is at[32]
    assert nearest_heads_entry(_NAMES, [32, 32, 128, 128, 64, False, _BF16], at.values()) is at[32]  # its own
    for other in ([4, 4, 64, 128, 64, False, _BF16],  # another head dimension: tiles differ
                  [4, 4, 128, 128, 64, True, _BF16],  # another flag
                  [4, 4, 128, 128, 64, False, "torch.float32"],  # another dtype
                  [4, 4, 128, 128, 64, False, _BF16, "torch.int64"]):  # another argument list
        assert nearest_heads_entry(_NAMES, other, at.values()) is None, other
    assert nearest_heads_entry(["K", "V", "BT", "H2", "X"], key, at.values()) is None  # no head count named
    grouped = [_entry([4, 8, 128, 128, 64, False, _BF16], 1), _entry([4, 4, 128, 128, 64, False, _BF16], 2)]
    assert nearest_heads_entry(_NAMES, [2, 4, 128, 128, 64, False, _BF16], grouped) is grouped[0]  # HV / H kept


class _FlaKey:
    """FLA's ``AutotuneKey``: the key's values."""

    def __init__(self, autotune_key):
        self.autotune_key = tuple(autotune_key)


class _FlaAutotuner:
    """FLA's ``CachedAutotuner`` in strict mode: a key's exact entry of its file into ``cache``, except the
    configurations its pruning refuses (``BV`` in ``refused``)."""

    keys = arg_names = _NAMES
    kernel_name = "a_kernel"

    def __init__(self, folder, refused=()):
        self.cache, self.folder, self.refused = {}, folder, refused

    def maybe_load_cached_config(self, key, nargs, runtime_kwargs):
        for entry in json.loads((self.folder / "a_kernel.json").read_text())["autotune_entries"].values():
            config = entry["config"]["kwargs"]
            if tuple(entry["autotune_key"]) == key.autotune_key and config["BV"] not in self.refused:
                self.cache[key.autotune_key] = config


def _ask(autotuner, key):
    """What FLA's autotuner does before tuning a key missing from its cache; the configuration it then runs."""
    nargs = dict(zip(_NAMES, key))  # the key's leading values are arguments by these names
    autotuner.maybe_load_cached_config(_FlaKey(key), nargs, {})
    return autotuner.cache.get(tuple(key))


def test_fla_takes_a_lent_configuration_instead_of_autotuning(tmp_path, caplog):
    import logging

    from kdacp.backends.fla_configs import lend_configs_across_heads

    class Autotuner(_FlaAutotuner):
        pass
    entries = [_entry([h, h, 128, 128, 64, False, _BF16], bv) for h, bv in ((8, 32), (32, 64))]
    (tmp_path / "a_kernel.json").write_text(json.dumps(
        {"kernel_name": "a_kernel", "autotune_entries": {fla_key_hash(e["autotune_key"]): e for e in entries}}))
    four, three_k = [4, 4, 128, 128, 64, False, _BF16], [4, 4, 64, 128, 64, False, _BF16]
    assert _ask(Autotuner(tmp_path), four) is None  # FLA alone: a miss, then minutes of autotuning
    reading = [True]
    assert lend_configs_across_heads(Autotuner, lambda: tmp_path, lambda: reading[0])
    assert not lend_configs_across_heads(Autotuner, lambda: tmp_path, lambda: reading[0])  # once
    with caplog.at_level(logging.INFO, logger="kdacp.backends.fla_configs"):
        assert _ask(Autotuner(tmp_path), four) == {"BV": 32}  # the 8-head entry's
        assert _ask(Autotuner(tmp_path), [32, 32, 128, 128, 64, False, _BF16]) == {"BV": 64}  # its own
    assert [r.getMessage() for r in caplog.records if "using the one tuned at" in r.getMessage()] == [
        f"kdacp: FLA's a_kernel has no configuration for the key {four}; using the one tuned at "
        f"{[8, 8, 128, 128, 64, False, _BF16]} (`kdacp tune --heads` tunes it)"]
    assert _ask(Autotuner(tmp_path), three_k) is None  # not across head dimensions
    assert _ask(Autotuner(tmp_path, refused=(32,)), four) is None  # FLA's pruning has the last word
    reading[0] = False  # kdacp tune: FLA reads no files, so nothing is lent either
    assert _ask(Autotuner(tmp_path), four) is None


def test_the_shipped_state_pass_entries_lend_to_tensor_parallel_head_counts():
    """The H200's shipped entries of FLA's state pass serve the head counts tensor parallelism leaves (2 to 16 of
    a 32-head layer), one sequence and several, without autotuning."""
    from kdacp.backends.fla_configs import nearest_heads_entry
    path = SHIPPED_CONFIGS / "NVIDIA_H200" / "chunk_gated_delta_rule_fwd_kernel_h_blockdim64.json"
    entries = json.loads(path.read_text())["autotune_entries"].values()
    bf16, f32, i64 = _BF16, "torch.float32", "torch.int64"
    for heads in (2, 4, 16):
        for tail in ([bf16, bf16, bf16, bf16, f32, bf16, f32], [bf16, bf16, bf16, bf16, f32, bf16, f32, i64, i64]):
            key = [heads, heads, 128, 128, 64, False, *tail]
            assert nearest_heads_entry(_NAMES, key, entries) is not None, key


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core importable")
def test_flas_autotuner_runs_a_lent_configuration_without_tuning(tmp_path, monkeypatch):
    import torch
    import triton
    import triton.language as tl
    from fla.ops.utils import cache

    from kdacp.backends.fla_configs import lend_configs_across_heads
    monkeypatch.setattr(cache.CachedAutotuner, "maybe_load_cached_config",
                        cache.CachedAutotuner.maybe_load_cached_config)  # restored afterwards
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.STRICT)
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))

    @cache.fla_cache_autotune(configs=[triton.Config({"BT": bt}, num_warps=1) for bt in (4, 8)], key=["H", "D"])
    @triton.jit
    def lent_kernel(x, y, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.arange(0, H * D)
        mask = (rows < T)[:, None]
        v = tl.load(x + rows[:, None] * H * D + cols[None, :], mask=mask, other=0.0)
        tl.store(y + rows[:, None] * H * D + cols[None, :], v * 3, mask=mask)

    f32 = "torch.float32"
    entry = _entry([8, 4, f32, f32], 0)
    entry["config"]["kwargs"] = {"BT": 8}
    (tmp_path / "lent_kernel.json").write_text(json.dumps(
        {"kernel_name": "lent_kernel", "autotune_entries": {fla_key_hash(entry["autotune_key"]): entry}}))
    assert lend_configs_across_heads(cache.CachedAutotuner, cache.get_fla_config_dir,
                                     lambda: cache.FLA_CACHE_MODE is not cache.FlaCacheMode.DISABLED)

    def no_tuning(*args, **kwargs):
        raise AssertionError("a key that differs from a shipped one only in its heads was autotuned")
    lent_kernel._bench = no_tuning
    x = torch.randn(20, 2 * 4)
    y = torch.empty_like(x)
    lent_kernel[lambda meta: (triton.cdiv(20, meta["BT"]),)](x, y, 20, H=2, D=4)
    assert lent_kernel.best_config.kwargs == {"BT": 8}
    torch.testing.assert_close(y, 3 * x)
