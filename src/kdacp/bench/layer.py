"""KimiDeltaAttention layer step (forward + backward): kdacp's layer beside FLA's, on one GPU and context-parallel.

Every rank holds ``t_local`` tokens of a global batch (one sequence, or packed documents cut at the
rank edges: :mod:`kdacp.bench.batches`). Contenders, timed round-robin in one run (blocks of warm
iterations, CUDA events where there is CUDA, the slowest rank's time):

- ``kdacp_one_rank`` / ``fla_one_rank``: kdacp's and FLA's (``fla.layers.KimiDeltaAttention``, same
  weights, CUDA only) layer on this rank's own tokens alone, with its own ``cu_seqlens``: the one-rank
  (one-GPU) baseline holding the same tokens;
- ``kdacp_attn_gym_one_rank``: kdacp's layer (same weights) with ``backend="attn_gym"`` (attention-gym's KDA
  core for training), where it is usable (a Hopper GPU, ``kdacp[attn-gym]`` installed);
- ``kdacp_<mode>``: kdacp's layer with ``ContextParallel(mode)`` over the group, on the global batch,
  for each of ``modes`` (``state``, ``ulysses``, ``hybrid``: Ulysses groups of the world size's smallest
  divisor, state passing across them).

``ratio``: the row's time over ``fla_one_rank``'s (over ``kdacp_one_rank``'s where FLA's layer is not
installed or on CPU). Kimi Linear's settings: safe gate with ``lower_bound=-5``, ``conv_size=4``.

``family="gdn"``: kdacp's ``GatedDeltaNet`` instead, with Qwen3-Next's head ratio (``heads // 2`` q/k heads,
``heads`` value heads) and no FLA layer (FLA 0.6.0 refuses its GDN backward on Hopper under Triton 3.6):
``kdacp_one_rank`` is kdacp's GDN path with ``backend`` (``fla``: FLA's KDA kernels on the broadcast gate
there), the base of the ratios.

    kdacp bench --suite layer [--modes state,ulysses] [--family gdn]
    (or under torchrun: torchrun --nproc-per-node 2 -m kdacp.cli bench --suite layer)

``run(...)`` returns the rows; call it on every rank of an initialised process group.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from kdacp.backends import backend_usable
from kdacp.cp.context import hybrid_ulysses_size
from kdacp.cp import new_cp_group
from kdacp.cp import ContextParallel
from kdacp.layers import GatedDeltaNet, KimiDeltaAttention

from .batches import BATCHES, cu_seqlens_of, document_lengths, local_cu_seqlens
from .harness import PlotSpec
from .timing import peak_gb, time_round_robin

MULTI_RANK = True
PLOTS = {"layer_step": PlotSpec(x="label", y="ms", panel="batch", bars=True,
                                title="layer step (fwd+bwd) per rank", ylabel="ms")}


def fla_layer_like(layer: KimiDeltaAttention):
    """FLA's ``KimiDeltaAttention`` with ``layer``'s configuration and weights (``A_log``/``dt_bias`` kept
    float32, as in kdacp's layer), or None when ``flash-linear-attention`` is not installed."""
    from kdacp.backends.fla_adapter import load_fla_layer
    try:
        cls = load_fla_layer()
    except ImportError:
        return None
    p = layer.q_proj.weight
    fla = cls(hidden_size=layer.hidden_size, head_dim=layer.head_k_dim, expand_v=layer.head_v_dim / layer.head_k_dim,
              num_heads=layer.num_heads, num_v_heads=layer.num_v_heads, conv_size=layer.conv_size,
              conv_bias=layer.q_conv1d.bias is not None, safe_gate=layer.gate_lower_bound is not None,
              lower_bound=layer.gate_lower_bound, norm_eps=layer.o_norm.eps).to(p.device, p.dtype)
    fla.A_log.data, fla.dt_bias.data = fla.A_log.data.float(), fla.dt_bias.data.float()
    fla.load_state_dict(layer.state_dict())
    return fla


# the layer of each family from (hidden, heads, head_dim, backend, device, dtype)
LAYERS = {
    "kda": lambda hidden, heads, d, backend, device, dtype: KimiDeltaAttention(
        hidden, heads, head_k_dim=d, head_v_dim=d, backend=backend, device=device, dtype=dtype),
    "gdn": lambda hidden, heads, d, backend, device, dtype: GatedDeltaNet(
        hidden, max(heads // 2, 1), heads, head_k_dim=d, head_v_dim=d, backend=backend, device=device, dtype=dtype),
}


def layer_step(layer, x: torch.Tensor, dy: torch.Tensor, cu_seqlens: torch.Tensor | None) -> None:
    """Forward and backward of one layer call (kdacp's or FLA's); gradients of ``x`` and every parameter."""
    y = layer(x, cu_seqlens=cu_seqlens)[0]
    torch.autograd.grad(y, [x, *layer.parameters()], dy)


def memory_bytes(world_size: int, **case) -> int:
    """A lower bound of the bytes one rank of :func:`run` holds at once with ``case`` (its keyword arguments;
    :func:`run`'s defaults for the others), from the sizes alone (for refusing sizes that cannot fit before
    any worker starts): the global input and output gradient ``[t_local * world_size, hidden]`` every rank
    draws, the layer's q, k, v and output projections (``hidden x heads x head_dim`` each) with their
    gradients, and the rank's q, k, v and gate ``[t_local, heads, head_dim]``."""
    given = inspect.signature(run).bind_partial(**case)
    given.apply_defaults()
    a = given.arguments
    width = torch.empty((), dtype=a["dtype"]).element_size()
    inner = a["heads"] * a["head_dim"]
    return width * (2 * a["t_local"] * world_size * a["hidden"] + 2 * 4 * a["hidden"] * inner + 4 * a["t_local"] * inner)


def run(t_local: int = 16384, hidden: int = 2048, heads: int = 32, head_dim: int = 128, modes=("state",),
        batches=BATCHES, warmup: int = 2, rounds: int = 3, iters: int = 5, group=None, device="cuda",
        dtype=torch.bfloat16, backend: str = "fla", seed: int = 0, report=None, family: str = "kda") -> list[dict]:
    """Rows ``batch, docs, run, label, ranks, tokens_per_rank, ms, ratio, peak_GB`` per batch and contender.

    ``batches``: names from :data:`kdacp.bench.batches.BATCHES`; ``modes``: the context-parallel modes
    (none on one rank); ``report(row)``: called as each row completes. Call on every rank of ``group``
    (default: a new :func:`new_cp_group`).
    """
    device = torch.device(device)
    group = group or new_cp_group()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if "hybrid" in modes and hybrid_ulysses_size(world_size) is None:
        raise ValueError(f"hybrid needs a world size with a divisor between 1 and itself; {world_size} has none")
    if family not in LAYERS:
        raise ValueError(f"family must be one of {tuple(LAYERS)}, got {family!r}")
    torch.manual_seed(seed)  # replicated parameters
    ours = LAYERS[family](hidden, heads, head_dim, backend, device, dtype)
    fla = fla_layer_like(ours) if device.type == "cuda" and family == "kda" else None
    attn_gym = None
    if backend != "attn_gym" and backend_usable("attn_gym", device):
        attn_gym = LAYERS[family](hidden, heads, head_dim, "attn_gym", device, dtype)
        attn_gym.load_state_dict(ours.state_dict())
    cps = {mode: ContextParallel(mode, group, ulysses_size=hybrid_ulysses_size(world_size) if mode == "hybrid"
                                    else None) for mode in (modes if world_size > 1 else ())}
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    rows = []
    for batch in batches:
        T = t_local * world_size
        lengths = document_lengths(batch, T, seed=seed)
        cu = cu_seqlens_of(lengths)
        x = torch.randn(1, T, hidden, device=device, generator=gen, dtype=dtype)
        dy = torch.randn(1, T, hidden, device=device, generator=gen, dtype=dtype)
        own = slice(rank * t_local, (rank + 1) * t_local)
        x_own, dy_own = x[:, own].clone().requires_grad_(), dy[:, own].contiguous()
        packed = len(lengths) > 1
        cu_global = torch.tensor(cu, device=device) if packed else None
        cu_own = local_cu_seqlens(cu, own.start, own.stop)
        cu_own = torch.tensor(cu_own, device=device) if len(cu_own) > 2 else None

        def one_rank(layer):
            return lambda: layer_step(layer, x_own, dy_own, cu_own)

        def context_parallel(cp):
            def step():
                ours.cp = cp
                try:
                    layer_step(ours, x_own, dy_own, cu_global)
                finally:
                    ours.cp = None
            return step

        fns = {"kdacp_one_rank": one_rank(ours)}
        if fla is not None:
            fns["fla_one_rank"] = one_rank(fla)
        if attn_gym is not None:
            fns["kdacp_attn_gym_one_rank"] = one_rank(attn_gym)
        fns.update({f"kdacp_{mode}": context_parallel(cp) for mode, cp in cps.items()})
        ms = time_round_robin(fns, warmup, rounds, iters, group, device)
        base = ms.get("fla_one_rank", ms["kdacp_one_rank"])
        for name, fn in fns.items():
            ranks = world_size if name in {f"kdacp_{m}" for m in cps} else 1
            row = dict(family=family, batch=batch, docs=len(lengths), run=name, label=f"{name} ({batch})",
                       ranks=ranks, tokens_per_rank=t_local, ms=ms[name], ratio=ms[name] / base,
                       peak_GB=peak_gb(fn, group, device))
            rows.append(row)
            if report is not None:
                report(row)
        del x, dy, x_own, dy_own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
