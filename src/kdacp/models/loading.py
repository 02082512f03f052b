"""Loading transformers' model modules (FLA first, with kdacp's tuning) and their PyTorch fallbacks."""
from __future__ import annotations

import contextlib
import importlib
import inspect


def load_model_module(module_path: str, what: str):
    """transformers' ``module_path`` (a ``modeling_*`` module), with FLA loaded first by kdacp.

    Importing such a module imports FLA where installed (transformers' kernel fallback), and FLA reads
    ``FLA_CACHE_MODE`` once, at import: so kdacp loads FLA first, pointed at kdacp's tuned configurations
    (:func:`kdacp.tuning.use_shipped_configs`).

    Raises:
        ImportError: transformers missing or without the model (the ``models`` extra).
    """
    from ..backends.fla_adapter import fla_available
    fla_available()
    try:
        return importlib.import_module(module_path)
    except ImportError as e:  # transformers < 5.x or missing: the `models` extra
        raise ImportError(f"kdacp.parallelize needs Hugging Face transformers with {what}: "
                          "pip install 'kdacp[models]'") from e


@contextlib.contextmanager
def kernel_fallbacks(module, names: tuple[str, ...]):
    """Inside the block, the functions ``names`` of ``module`` are the PyTorch code they wrap
    (``inspect.unwrap``); restored on exit. Names the module lacks are skipped."""
    saved = {name: getattr(module, name) for name in names if hasattr(module, name)}
    try:
        for name, fn in saved.items():
            setattr(module, name, inspect.unwrap(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
