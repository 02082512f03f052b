"""Loading transformers' model modules (FLA first, with kdacp's tuning) and their PyTorch fallbacks."""
from __future__ import annotations

import contextlib
import importlib
import inspect
import logging

# transformers' notice, one per kernel function it wraps, when a function runs its PyTorch code
_FALLBACK_NOTICE = "is falling back to its reference PyTorch implementation"
_FALLBACK_LOGGER = "transformers.integrations.hub_kernels"


class _FallbackNoticeOnce(logging.Filter):
    """Passes the first of transformers' kernel-fallback notices (saying that it stands for all of them) and
    drops the others: each wrapped function (short convolution, its decoding update, the chunked and the
    recurrent delta rule) would otherwise print its own."""

    def __init__(self):
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _FALLBACK_NOTICE not in message:
            return True
        if self.said:
            return False
        self.said = True
        record.msg, record.args = f"{message} (said once for all of transformers' kernel functions)", ()
        return True


def say_kernel_fallbacks_once() -> None:
    """From now on, transformers' "falling back to its reference PyTorch implementation" notices are printed once
    in the process, not once per kernel function (a filter on transformers' kernel logger; idempotent)."""
    logger = logging.getLogger(_FALLBACK_LOGGER)
    if not any(isinstance(f, _FallbackNoticeOnce) for f in logger.filters):
        logger.addFilter(_FallbackNoticeOnce())


def load_model_module(module_path: str, what: str):
    """transformers' ``module_path`` (a ``modeling_*`` module), with FLA loaded first by kdacp.

    Importing such a module imports FLA where installed (transformers' kernel fallback), and FLA reads
    ``FLA_CACHE_MODE`` once, at import: so kdacp loads FLA first, pointed at kdacp's tuned configurations
    (:func:`kdacp.tuning.use_shipped_configs`). transformers' kernel-fallback notices are then printed once
    (:func:`say_kernel_fallbacks_once`).

    Raises:
        ImportError: transformers missing or without the model (the ``models`` extra).
    """
    from ...backends.fla_adapter import fla_available
    fla_available()
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:  # transformers < 5.x or missing: the `models` extra
        raise ImportError(f"kdacp.parallelize needs Hugging Face transformers with {what}: "
                          "pip install 'kdacp[models]'") from e
    say_kernel_fallbacks_once()
    return module


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
