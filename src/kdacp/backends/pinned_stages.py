"""An optional, version-pinned dependency's stage functions, looked up by name and loaded once.

kdacp calls internal functions of FLA and attention-gym, which change between releases: each adapter
pins one version, names its stages as ``{name: (module, attribute)}``, and reports every missing piece
in one message instead of failing deep inside a kernel call.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import torch

__all__ = ["PinnedStages", "import_stages", "installed_version", "load_pinned"]

Loaded = tuple[SimpleNamespace | None, str | None]


def installed_version(distribution: str) -> str | None:
    """The installed version of the package ``distribution`` (its name on the index), or None."""
    from importlib import metadata
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def load_pinned(distribution: str, required: str, stages: dict[str, tuple[str, str]], *, version: str | None,
                import_module: Callable[[str], ModuleType], install_hint: str, why_pinned: str,
                kernels_hint: str) -> Loaded:
    """An adapter's ``load``: ``(namespace of stages, None)`` where ``distribution`` is installed at exactly
    ``required`` and every stage imports, else ``(None, reason)`` naming what is missing.

    Args:
        version: the installed version (None: not installed); import_module: as :func:`import_stages`'.
        install_hint: how to install it; why_pinned: why kdacp needs that exact version; kernels_hint: what its
            kernels need where they do not import.
    """
    if version is None:
        return None, f"{distribution} is not installed; {install_hint}"
    if version != required:
        return None, f"kdacp needs {distribution}=={required} ({why_pinned}), found {version}"
    found, missing = import_stages(stages, import_module)
    if missing:
        return None, (f"{distribution} {version}'s GPU kernels are not importable: " + "; ".join(missing)
                      + f". {kernels_hint}; {install_hint}")
    return SimpleNamespace(**found), None


def import_stages(stages: dict[str, tuple[str, str]],
                  import_module: Callable[[str], ModuleType] = importlib.import_module
                  ) -> tuple[dict[str, object], list[str]]:
    """Import each ``(module, attribute)`` of ``stages``; each module is tried once.

    Returns:
        ``(found, missing)``: the objects by stage name, and one line per module that failed to import
        (``"module (Error: message)"``) or attribute it lacks (``"module.attribute (AttributeError: ...)"``).
        Any exception counts as "not usable": a GPU-only module may fail with other errors than ImportError.
    """
    found, modules, missing = {}, {}, []
    for name, (module, attr) in stages.items():
        if module not in modules:
            try:
                modules[module] = import_module(module)
            except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
                modules[module] = None
                missing.append(f"{module} ({type(e).__name__}: {e})")
        if modules[module] is None:
            continue
        try:
            found[name] = getattr(modules[module], attr)
        except AttributeError as e:
            missing.append(f"{module}.{attr} (AttributeError: {e})")
    return found, missing


class PinnedStages:
    """The public face of an adapter's ``load`` function.

    Args:
        load: returns ``(namespace, None)`` when the dependency is usable, else ``(None, reason)``; the
            adapter memoises it (``functools.cache``), so this object asks it each time and tests may
            clear it.

    Inside ``torch.compile``'s tracing the load runs as plain Python (:func:`_run_load`), once per trace: the
    dependency's import and version checks are never traced (a layer compiled before the dependency was imported
    would trace its import, and a lookup traced through the memo breaks the graph).
    """

    def __init__(self, load: Callable[[], Loaded]):
        self._load = load
        self.loaded: Loaded = (None, None)  # the last load's answer, set by _run_load
        self._index = len(_ALL)  # what _run_load is called with: an int, a constant to every torch.compile
        _ALL.append(self)

    def available(self) -> bool:
        """Whether the stages can be used here."""
        return _run_load(self._index) is None

    def require(self) -> None:
        """Raise ImportError saying what is missing unless the stages can be used."""
        reason = _run_load(self._index)
        if reason is not None:
            raise ImportError(reason)

    def load(self) -> SimpleNamespace:
        """The stage functions by name; raises ImportError when unusable."""
        self.require()
        return self.loaded[0]


# every PinnedStages made, by its _index (one per adapter module, and those tests make)
_ALL: list[PinnedStages] = []


@torch.compiler.assume_constant_result
def _run_load(index: int) -> str | None:
    """Run the load of ``_ALL[index]``, keep its answer in its ``loaded`` and return its reason (None: usable).
    Under ``torch.compile`` this runs at trace time as plain Python and its result is a constant of the graph.
    Its argument is an int: torch 2.11's Dynamo takes only Python constants as such a function's arguments."""
    stages = _ALL[index]
    stages.loaded = stages._load()
    return stages.loaded[1]
