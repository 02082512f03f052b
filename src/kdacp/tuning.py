"""``kdacp tune``: FLA's kernel configurations made on the user's GPU for kdacp's layer.

The files, how FLA reads them and how kdacp points FLA at them are :mod:`kdacp.backends.fla_configs`.
This module runs the layer, so it sits above it; the backends never import it.
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path

from .backends import fla_configs
from .backends.fla_configs import add_missing_entries, choose_config_dir, export_fla_configs, gpu_dir_name


def tune(out_dir: str | Path | None = None, *, t_local=(16384, 2048), hidden: int = 2048, heads: int = 32,
         head_dim: int = 128, batches=("one_sequence", "docs7"), gates=(-5.0, None)) -> list[Path]:
    """Autotune FLA's kernels for kdacp's layer on this GPU and write FLA configuration files.

    Runs one forward and backward of :class:`kdacp.KimiDeltaAttention` (``fla`` backend, bf16) per
    gate in ``gates`` (``gate_lower_bound``: -5 is Kimi Linear's safe gate, None the softplus gate of
    transformers' Kimi Linear; FLA runs different kernels for each), batch, and token count in
    ``t_local`` (an int or several: some kernels, such as the gated norm, key their tuning on the
    token count), with FLA autotuning into a fresh Triton cache, then
    exports the kernels that read FLA's configuration directory into ``out_dir`` (default:
    :data:`~kdacp.backends.fla_configs.USER_CONFIGS` / the GPU's name, which kdacp then prefers over its
    shipped files). The entries it did not tune come from the configurations kdacp used on this GPU
    before (its shipped ones, or a sibling GPU's: :func:`~kdacp.backends.fla_configs.choose_config_dir`),
    so the new folder, which replaces that one, serves every shape it served.

    Returns:
        The files written, sorted.

    Raises:
        RuntimeError: no CUDA GPU, or FLA was imported already in this process (its settings are read
            at import, so tuning needs a fresh process: ``kdacp tune``).
    """
    import sys
    import tempfile

    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("tuning needs a CUDA GPU (it times FLA's kernels on it)")
    if "fla" in sys.modules:
        raise RuntimeError("tuning must run in a fresh process (FLA reads its settings at import, and it was "
                           "imported already)")
    gpu = torch.cuda.get_device_name()
    out = Path(out_dir) if out_dir is not None else fla_configs.USER_CONFIGS / gpu_dir_name(gpu)
    before = choose_config_dir(gpu, tuple(torch.cuda.get_device_capability()))
    saved = {name: os.environ.get(name) for name in ("TRITON_CACHE_DIR", "FLA_CACHE_MODE")}
    with tempfile.TemporaryDirectory(prefix="kdacp-tune-") as cache:
        os.environ["TRITON_CACHE_DIR"], os.environ["FLA_CACHE_MODE"] = cache, "disabled"  # tune afresh
        try:
            tuned = _tune_into(cache, out, t_local, hidden, heads, head_dim, batches, gates)
        finally:  # the temporary cache goes away: leave no variable pointing at it
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    filled = add_missing_entries(out, before) if before is not None and before.resolve() != out.resolve() else []
    return sorted(set(tuned) | set(filled))


def _tune_into(cache: str, out: Path, t_local, hidden: int, heads: int, head_dim: int, batches,
               gates) -> list[Path]:
    """:func:`tune`'s work, with the Triton cache at ``cache`` and FLA's config lookup off."""
    import torch

    from .backends.fla_adapter import autotuned_kernel_names
    from .bench.batches import cu_seqlens_of, document_lengths
    from .bench.layer import layer_step
    from .layers import KimiDeltaAttention
    from .precompilation import precompile
    layers = [KimiDeltaAttention(hidden, heads, head_k_dim=head_dim, head_v_dim=head_dim, backend="fla",
                                 gate_lower_bound=gate, device="cuda", dtype=torch.bfloat16) for gate in gates]
    for layer, tokens, batch in itertools.product(layers, (t_local,) if isinstance(t_local, int) else t_local,
                                                   batches):
        cu = cu_seqlens_of(document_lengths(batch, tokens))
        x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy, cu = torch.randn_like(x), torch.tensor(cu, device="cuda") if len(cu) > 2 else None
        # every configuration of the kernels still to tune compiled at once, so that the tuning only times them
        precompile(lambda: layer_step(layer, x, dy, cu), device="cuda", configs=True)
        layer_step(layer, x, dy, cu)
    torch.cuda.synchronize()
    return export_fla_configs(cache, out, kernels=autotuned_kernel_names())
