"""Tuned FLA kernel configurations: shipped with kdacp for the GPUs it was measured on, so that FLA's
first use of a shape does not autotune (minutes on a cold machine).

FLA 0.6.0 looks a kernel's configuration up in ``$FLA_CONFIG_DIR/<kernel name>.json`` when
``FLA_CACHE_MODE`` says so (read once, when FLA is imported), keyed by the kernel's autotune key (its
key arguments' values and its tensor arguments' dtypes); on a miss it autotunes as usual.
:func:`use_shipped_configs` points FLA at kdacp's files for the GPU at hand, unless the user set either
variable; a GPU without its own files takes those of the nearest shipped GPU of its architecture
(:func:`choose_config_dir`), so that a first run never autotunes for minutes where a sibling's files
serve. :func:`export_fla_configs` turns a Triton autotune cache (``TRITON_CACHE_DIR``, where FLA's
autotuner records its timings) into such files, which is how the shipped ones were made; making
them on the user's GPU is :func:`kdacp.tuning.tune`.

FLA's key holds no sequence count, so an entry tuned on one shape serves every count of sequences: the shipped
H200 entry of the state pass (``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``) over several sequences with
incoming states, a context-parallel rank's pass, is set from a measurement of rank shapes (``BV = 64``;
benchmarks/RESULTS.md, Per-rank overhead) and guarded by a test, since a re-export would overwrite it.

FLA's key also holds the head counts (``H``, ``HV``), which tensor parallelism changes (a 32-head layer at TP 8
holds 4) and which only size a kernel's grid, never a program's tiles. Where kdacp points FLA at its files, a kernel
shape they lack that differs from an entry only in its head counts takes that entry's configuration (the nearest
head count), logged once, rather than autotuning: :func:`lend_configs_across_heads`. On one H100, FLA's autotuning
of the shapes of 4 heads at 64K tokens took 336 s of a 370 s benchmark run (benchmarks/RESULTS.md, Demo cold
start); ``kdacp tune --heads`` tunes a GPU's own.

A few FLA kernels (the gated norm of ``fla.modules.norm.fused_norm_gate``) use Triton's plain autotuner,
which never reads those files; :func:`seed_autotuner` gives such an autotuner the file's entries as
already-tuned results, which is what FLA's own autotuner does on an exact key match.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

from ..choices import USER_CONFIGS

SHIPPED_CONFIGS = Path(__file__).parent.parent / "configs"


# The CUDA compute capability of each GPU kdacp ships configurations for. A GPU without files of its own
# takes those of a shipped GPU of its capability: a configuration is sized to the chip's shared memory,
# registers and units, which the capability fixes, so a sibling's runs (an H100 PCIe takes the H100 80GB's) and
# saves the minutes of autotuning; one of another capability is never taken (it may not even launch). The H100's
# were tuned on an H100 80GB HBM3 by `kdacp tune` at the demo's and the layer suite's shapes (the H200's entries
# for the rest): benchmarks/RESULTS.md, First run.
SHIPPED_CAPABILITY = {"NVIDIA_H100_80GB_HBM3": (9, 0), "NVIDIA_H200": (9, 0)}

log = logging.getLogger(__name__)


def gpu_dir_name(device_name: str) -> str:
    """FLA's directory name for a GPU (``"NVIDIA H200"`` -> ``"NVIDIA_H200"``)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def choose_config_dir(device_name: str, capability: tuple[int, int] | None = None,
                      user_dir: Path | None = None) -> Path | None:
    """The folder of FLA configurations for a GPU named ``device_name``: the user's own from ``kdacp tune``
    (in ``user_dir``, default :data:`USER_CONFIGS`), else kdacp's shipped ones for that GPU (in
    :data:`SHIPPED_CONFIGS`), else, given the GPU's compute ``capability``, the shipped ones of the GPU of that
    capability (:data:`SHIPPED_CAPABILITY`) whose name shares the most ``_``-separated parts with this
    one's (ties: the first by name; an ``NVIDIA H100 PCIe`` takes an ``NVIDIA_H100_...`` folder over
    ``NVIDIA_H200``). None when there is none of these."""
    name, shipped_dir = gpu_dir_name(device_name), SHIPPED_CONFIGS
    own = next((d for d in ((user_dir or USER_CONFIGS) / name, shipped_dir / name) if d.is_dir()), None)
    if own is not None or capability is None:
        return own
    parts = set(name.split("_"))
    siblings = [gpu for gpu, cap in sorted(SHIPPED_CAPABILITY.items())
                if cap == tuple(capability) and (shipped_dir / gpu).is_dir()]
    return shipped_dir / max(siblings, key=lambda gpu: len(parts & set(gpu.split("_")))) if siblings else None


def use_shipped_configs(device_name: str | None, environ=os.environ, user_dir: Path | None = None,
                        capability: tuple[int, int] | None = None) -> Path | None:
    """Set ``FLA_CONFIG_DIR`` to the configurations :func:`choose_config_dir` picks for ``device_name``
    (of compute ``capability``, which lets a GPU without files of its own take a sibling's) and
    ``FLA_CACHE_MODE`` to ``strict`` (exact key matches; anything else autotunes), unless the user set
    either variable or there are none. Returns the directory used, or None. FLA reads ``FLA_CACHE_MODE``
    when first imported: call it before, or hand an imported FLA the mode afterwards (as kdacp's adapter
    does)."""
    if device_name is None or "FLA_CONFIG_DIR" in environ or "FLA_CACHE_MODE" in environ:
        return None
    folder = choose_config_dir(device_name, capability, user_dir)
    if folder is None:
        return None
    environ["FLA_CONFIG_DIR"], environ["FLA_CACHE_MODE"] = str(folder), "strict"
    return folder


def use_configs_for_this_gpu(environ=os.environ, user_dir: Path | None = None) -> Path | None:
    """:func:`use_shipped_configs` for the current CUDA device, saying in one logged line (a warning of
    this module's logger, on stderr where logging is not set up) when the GPU has no configurations of
    its own: whose are used, or that FLA will autotune, and that ``kdacp tune`` makes the GPU's own. Says
    nothing where the user set FLA's variables, and only on the first local rank under torchrun
    (``LOCAL_RANK`` 0 or unset). Returns the directory used, or None (no CUDA device, none apply)."""
    import torch
    if not torch.cuda.is_available():
        return None
    name, capability = torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability())
    user_set = "FLA_CONFIG_DIR" in environ or "FLA_CACHE_MODE" in environ
    folder = use_shipped_configs(name, environ, user_dir, capability)
    own = folder is not None and folder.name == gpu_dir_name(name)
    if user_set or own or environ.get("LOCAL_RANK", "0") != "0":
        return folder
    how = f"`kdacp tune` makes this GPU's own (into {(user_dir or USER_CONFIGS) / gpu_dir_name(name)})"
    arch = f"sm_{capability[0]}{capability[1]}"
    if folder is None:
        log.warning(f"kdacp: no FLA kernel configurations for the {name} ({arch}): FLA autotunes each new kernel "
                    f"shape at its first use, minutes in a first run; {how}")
    else:
        log.warning(f"kdacp: no FLA kernel configurations for the {name}; using the shipped ones of the "
                    f"{folder.name.replace('_', ' ')} (same architecture, {arch}); {how}")
    return folder


def fla_key_hash(key: list) -> str:
    """The hash FLA files an autotune entry under (its ``AutotuneKey.key_hash``)."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def _best(configs_timings: list) -> dict:
    """The configuration with the smallest mean timing."""
    return min(configs_timings, key=lambda ct: sum(ct[1]) / len(ct[1]))[0]


def export_fla_configs(triton_cache_dir: str | Path, out_dir: str | Path, kernels=None,
                       triton_version: str | None = None) -> list[Path]:
    """Write FLA configuration files from the autotune results in a Triton cache.

    Args:
        triton_cache_dir: a ``TRITON_CACHE_DIR`` holding ``<hash>/<kernel>.autotune.json`` files.
        out_dir: where ``<kernel>.json`` files go; entries already there are kept, the new win.
        kernels: only these kernel names (default: all found).
        triton_version: recorded in each file (default: the installed Triton's).

    Returns:
        The files written, sorted.
    """
    if triton_version is None:
        import triton
        triton_version = triton.__version__
    found: dict[str, dict] = {}
    for path in sorted(Path(triton_cache_dir).rglob("*.autotune.json")):
        name = path.name[:-len(".autotune.json")]
        if kernels is not None and name not in kernels:
            continue
        data = json.loads(path.read_text())
        key, best = data["key"], _best(data["configs_timings"])
        found.setdefault(name, {})[fla_key_hash(key)] = {"autotune_key": key, "config": best}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, entries in sorted(found.items()):
        path = out / f"{name}.json"
        old = json.loads(path.read_text()).get("autotune_entries", {}) if path.exists() else {}
        path.write_text(json.dumps({"kernel_name": name, "triton_version": triton_version,
                                    "autotune_entries": {**old, **entries}}, indent=1, sort_keys=True))
        written.append(path)
    return written


def add_missing_entries(out_dir: str | Path, base_dir: str | Path) -> list[Path]:
    """Give the configuration files in ``out_dir`` every entry of ``base_dir``'s that they lack, writing
    the files ``out_dir`` lacks whole; entries already in ``out_dir`` are kept. kdacp points FLA at one
    folder per GPU, so a folder tuned at a few shapes, filled from the folder used before it, still
    serves every shape that one served. Returns the files changed or written, sorted."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    changed = []
    for path in sorted(Path(base_dir).glob("*.json")):
        base = json.loads(path.read_text())
        target = out / path.name
        mine = json.loads(target.read_text()) if target.exists() else {**base, "autotune_entries": {}}
        missing = {h: e for h, e in base["autotune_entries"].items() if h not in mine["autotune_entries"]}
        if missing:
            mine["autotune_entries"].update(missing)
            target.write_text(json.dumps(mine, indent=1, sort_keys=True))
            changed.append(target)
    return changed


def autotuner_kernel_name(autotuner) -> str:
    """The kernel name a Triton autotuner is filed under (its jitted function's name, as FLA names it)."""
    fn = autotuner.fn
    return getattr(fn, "fn", fn).__name__


def _entries(config_dir, kernel_name: str) -> list[dict]:
    """The autotune entries of ``kernel_name``'s file in ``config_dir`` (none where either is missing)."""
    path = None if not config_dir else Path(config_dir) / f"{kernel_name}.json"
    if path is None or not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("autotune_entries", {}).values())


def seed_autotuner(autotuner, config_dir: str | Path) -> int:
    """Give a Triton ``Autotuner`` the entries of ``config_dir/<kernel name>.json`` as tuned results
    (its ``cache``, keyed like FLA's entries: key values, then tensor dtypes); keys it has already
    tuned are kept. Returns the number of entries added (0 when there is no file)."""
    import inspect

    import triton
    accepted = set(inspect.signature(triton.Config).parameters)
    added = 0
    for entry in _entries(config_dir, autotuner_kernel_name(autotuner)):
        key, config = tuple(entry["autotune_key"]), entry["config"]
        if key in autotuner.cache:
            continue
        options = {k: config[k] for k in ("num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")
                   if k in config and k in accepted}
        autotuner.cache[key] = triton.Config(dict(config.get("kwargs") or {}), **options)
        added += 1
    return added


# The names FLA's kernels give their head counts in an autotune key: they size the grid, not a program's tiles or
# stages, so a configuration tuned at other head counts fits these.
HEAD_KEY_NAMES = frozenset({"H", "HV"})


def nearest_heads_entry(names, key, entries) -> dict | None:
    """The entry of ``entries`` (FLA autotune entries: ``{"autotune_key": [...], "config": {...}}``) lent to the
    autotune ``key`` of a kernel whose leading key values are named ``names`` (the tensor dtypes follow them): one
    whose key equals ``key`` everywhere but at the head counts (:data:`HEAD_KEY_NAMES`), with the same ratio of
    value heads to heads, nearest in head count (by ratio; a tie goes to more heads; ``key``'s own entry where it
    has one). None where there is none or ``key`` names no head count."""
    heads = [i for i, name in enumerate(names) if name in HEAD_KEY_NAMES]
    if not heads:
        return None
    key = list(key)
    best, best_rank = None, None
    for entry in entries:
        other = list(entry["autotune_key"])
        if len(other) != len(key) or any(
                a != b for i, (a, b) in enumerate(zip(other, key)) if i not in heads):
            continue
        counts = [(other[i], key[i]) for i in heads]
        if any(type(a) is not int or type(b) is not int or a <= 0 or b <= 0 for a, b in counts):
            continue
        if any(a * counts[0][1] != b * counts[0][0] for a, b in counts):  # another value heads / heads ratio
            continue
        theirs, ours = counts[0]
        rank = (max(theirs, ours) / min(theirs, ours), -theirs)
        if best_rank is None or rank < best_rank:
            best, best_rank = entry, rank
    return best


def autotune_key_names(autotuner, named_args: dict) -> list[str]:
    """The names of the leading values of ``autotuner``'s key for a launch with ``named_args`` (positional and
    keyword arguments by name): its key names among the kernel's arguments that the launch passes, as Triton and
    FLA's ``AutotuneKey.build`` take them (the tensor dtypes follow them in the key)."""
    return [name for name in autotuner.keys if name in named_args and name in autotuner.arg_names]


def lend_configs_across_heads(autotuner_cls, config_dir, enabled) -> bool:
    """Make FLA's configuration-reading autotuner class (``fla.ops.utils.cache.CachedAutotuner``) take, for a
    kernel shape its files lack, the entry :func:`nearest_heads_entry` lends from the file of that kernel in
    ``config_dir()`` (a folder), through FLA's own lookup and pruning (as if the lending entry's key had been
    asked), instead of autotuning; only while ``enabled()`` (FLA reads its files: not while ``kdacp tune`` tunes
    afresh). Once per class; returns whether it was installed now."""
    original = autotuner_cls.maybe_load_cached_config
    if getattr(original, "lends_across_heads", False):
        return False
    lent: set = set()

    def maybe_load_cached_config(self, key, nargs, runtime_kwargs):
        original(self, key, nargs, runtime_kwargs)
        if key.autotune_key in self.cache or not enabled():
            return
        names = autotune_key_names(self, {**nargs, **runtime_kwargs})
        entry = nearest_heads_entry(names, key.autotune_key, _entries(config_dir(), self.kernel_name))
        if entry is None:
            return
        lender = type(key)(autotune_key=tuple(entry["autotune_key"]))
        if lender.autotune_key not in self.cache:
            original(self, lender, nargs, runtime_kwargs)
            if lender.autotune_key not in self.cache:  # FLA's pruning refused it for these arguments
                return
        self.cache[key.autotune_key] = self.cache[lender.autotune_key]
        if (self.kernel_name, key.autotune_key) not in lent:
            lent.add((self.kernel_name, key.autotune_key))
            log.info(f"kdacp: FLA's {self.kernel_name} has no configuration for the key {list(key.autotune_key)}; "
                     f"using the one tuned at {list(entry['autotune_key'])} (`kdacp tune --heads` tunes it)")

    maybe_load_cached_config.lends_across_heads = True
    autotuner_cls.maybe_load_cached_config = maybe_load_cached_config
    return True
