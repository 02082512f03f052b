"""``kdacp demo``: a few training steps of a small KDA model, context-parallel, checked against
the single-process run of the same global batch.

Every rank holds an equal time shard of one long packed batch (sequences are cut across ranks
at arbitrary points). Each step runs forward and backward on the shards, all-reduces the
parameter gradients, and compares the rank's outputs (logits) and the gradients with a replica
model that runs the whole batch in one process (on rank 0, broadcast to the others).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .backends import resolve_backend
from .distributed import new_cp_group
from .layers import KDAContextParallel, KimiDeltaAttention
from .layers.context_parallel import MODES
from .workers import RankContext

__all__ = ["DemoConfig", "DemoModel", "demo_batch", "demo_config", "demo_worker", "sgd_step", "token_loss",
           "TOLERANCE"]


# Largest relative error (norm-wise) accepted between the context-parallel and the one-process run.
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2}


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs; ``seq_lens`` must add up to a multiple of ``world_size``, and the heads
    split over the ranks of a Ulysses group (:func:`demo_config` picks sizes that fit)."""

    world_size: int = 4
    seq_lens: tuple[int, ...] = (600, 250, 900, 298)
    mode: str = "state"
    strategy: str = "p2p"
    ulysses_size: int | None = None
    backend: str = "auto"
    device: str = "cpu"
    dtype: str = "float64"
    steps: int = 3
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_v_heads: int = 4
    head_dim: int = 16
    vocab_size: int = 256
    lr: float = 0.05
    seed: int = 0

    @property
    def ulysses_ranks(self) -> int | None:
        """Ranks that split each layer's heads: 1 (state), ``world_size`` (ulysses), ``ulysses_size`` (hybrid)."""
        return {"state": 1, "ulysses": self.world_size}.get(self.mode, self.ulysses_size)

    def validate(self) -> None:
        """Raise ``ValueError`` (in the command line's terms) unless every rank can run this config."""
        P, U = self.world_size, self.ulysses_ranks
        if P < 1:
            raise ValueError(f"--world-size must be >= 1, got {P}")
        if not self.seq_lens or min(self.seq_lens) < 1:
            raise ValueError(f"--seq-lens must be positive lengths, got {self.seq_lens}")
        T = sum(self.seq_lens)
        if T % P:
            raise ValueError(f"the sequence lengths add up to {T} tokens, which {P} ranks cannot "
                             f"split equally; make the total a multiple of --world-size")
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.mode != "hybrid" and self.ulysses_size is not None:
            raise ValueError(f"--ulysses-size is for --mode hybrid only, got --mode {self.mode}")
        if self.mode == "hybrid" and U is None:
            raise ValueError(f"--mode hybrid runs Ulysses inside groups and state passing across them, so the "
                             f"world size needs a divisor between 1 and itself; {P} has none (4 or 6 do)")
        if self.mode == "hybrid" and (not 1 < U < P or P % U):
            raise ValueError(f"--ulysses-size {U} must divide --world-size {P} and lie strictly between 1 and {P}")
        if self.num_heads < 1 or self.num_heads % U or self.num_v_heads % U:
            raise ValueError(f"--mode {self.mode} splits each layer's heads over {U} ranks, so --heads must be a "
                             f"positive multiple of {U}; got {self.num_heads} (value heads {self.num_v_heads})")
        if self.dtype not in TOLERANCE:
            raise ValueError(f"--dtype must be one of {sorted(TOLERANCE)}, got {self.dtype!r}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.backend == "fla" and self.device != "cuda":
            raise ValueError(f"--backend fla needs --device cuda (FLA's kernels are CUDA-only), got --device "
                             f"{self.device}; use --backend torch or auto")
        if self.backend == "fla":
            try:
                resolve_backend(self.backend, torch.device(self.device))
            except ImportError as e:
                raise ValueError(f"--backend fla: {e}") from None

    def describe(self) -> str:
        """One line naming what runs: ranks, mode, strategy (where state is passed), heads, dtype."""
        how = {"state": f"strategy {self.strategy}", "ulysses": "all-to-all over heads, no state passing",
               "hybrid": f"ulysses_size {self.ulysses_size}, strategy {self.strategy}"}[self.mode]
        return (f"{self.world_size} ranks, mode {self.mode} ({how}), {self.num_heads} q/k heads, "
                f"{self.num_v_heads} value heads, {self.dtype}, backend {self.backend}, {self.steps} steps")


def demo_config(world_size: int, mode: str = "state", *, ulysses_size: int | None = None,
                num_heads: int | None = None, **options) -> DemoConfig:
    """A :class:`DemoConfig` whose unset sizes fit ``world_size``; check it with ``validate()``.

    ``ulysses_size`` (hybrid): the smallest divisor of ``world_size`` between 1 and itself (None if
    there is none). ``num_heads``: 2, or the ranks that split the heads if more; ``num_v_heads`` is
    twice ``num_heads``.
    """
    if mode == "hybrid" and ulysses_size is None:
        ulysses_size = next((d for d in range(2, world_size) if world_size % d == 0), None)
    cfg = DemoConfig(world_size=world_size, mode=mode, ulysses_size=ulysses_size, **options)
    if num_heads is None:
        num_heads = max(2, cfg.ulysses_ranks or 1)
    return replace(cfg, num_heads=num_heads, num_v_heads=2 * num_heads)


class _Block(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        d = cfg.hidden_size
        self.attn_norm = nn.RMSNorm(d)
        self.attn = KimiDeltaAttention(d, cfg.num_heads, cfg.num_v_heads, head_k_dim=cfg.head_dim,
                                       head_v_dim=cfg.head_dim, backend=cfg.backend)
        self.mlp_norm = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))

    def forward(self, x, cu_seqlens):
        x = x + self.attn(self.attn_norm(x), cu_seqlens=cu_seqlens)[0]
        return x + self.mlp(self.mlp_norm(x))


class DemoModel(nn.Module):
    """Embedding, ``num_layers`` x (KDA + MLP) residual blocks, RMSNorm, LM head."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def set_context_parallel(self, cp: KDAContextParallel | None) -> None:
        for block in self.blocks:
            block.attn.cp = cp

    def forward(self, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cu_seqlens)
        return self.head(self.norm(x))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def demo_batch(cfg: DemoConfig, step: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global packed batch of a step: token ids and targets ``[1, T]``, ``cu_seqlens [N+1]``."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    T = sum(cfg.seq_lens)
    ids = torch.randint(cfg.vocab_size, (2, 1, T), generator=gen)
    cu = torch.tensor([0, *torch.tensor(cfg.seq_lens).cumsum(0).tolist()])
    return ids[0].to(device), ids[1].to(device), cu.to(device)


def token_loss(logits: torch.Tensor, targets: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """This rank's share of the global token-mean cross-entropy (its tokens' sum over ``total_tokens``)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / total_tokens


@torch.no_grad()
def sgd_step(params, lr: float) -> None:
    # Plain SGD by hand: torch.optim imports torch._dynamo, seconds of start-up per worker.
    for p in params:
        p.add_(p.grad, alpha=-lr)
        p.grad = None


def demo_worker(ctx: RankContext, cfg: DemoConfig) -> list[dict]:
    """One rank of the demo; returns every rank's row (gathered), so rank 0 can print the table."""
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    model = DemoModel(cfg).to(ctx.device, dtype)
    replica = copy.deepcopy(model)  # same initial weights on every rank
    model.set_context_parallel(KDAContextParallel(cfg.mode, new_cp_group(), strategy=cfg.strategy,
                                                  ulysses_size=cfg.ulysses_size))
    T = sum(cfg.seq_lens)
    T_local = T // ctx.world_size
    shard = slice(ctx.rank * T_local, (ctx.rank + 1) * T_local)
    out_err, grad_err, times = 0.0, 0.0, []
    for step in range(cfg.steps):
        ids, targets, cu = demo_batch(cfg, step, ctx.device)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(ids[:, shard], cu)
        token_loss(logits, targets[:, shard], T).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)

        full_logits = torch.empty(1, T, cfg.vocab_size, device=ctx.device, dtype=dtype)
        if ctx.rank == 0:
            full_logits = replica(ids, cu)
            token_loss(full_logits, targets, T).backward()
        else:
            for p in replica.parameters():
                p.grad = torch.empty_like(p)
        dist.broadcast(full_logits.detach(), 0)
        for p in replica.parameters():
            dist.broadcast(p.grad, 0)
        out_err = max(out_err, _rel_err(logits.detach(), full_logits[:, shard].detach()))
        pairs = zip(model.parameters(), replica.parameters())
        grad_err = max(grad_err, max(_rel_err(p.grad, r.grad) for p, r in pairs))
        sgd_step([*model.parameters(), *replica.parameters()], cfg.lr)
        ctx.report(("step", step + 1))

    cu_list = [0, *torch.tensor(cfg.seq_lens).cumsum(0).tolist()]
    pieces = sum(1 for a, b in zip(cu_list[:-1], cu_list[1:]) if a < shard.stop and b > shard.start)
    row = dict(rank=ctx.rank, tokens=T_local, sequences=pieces, step_ms=1e3 * sorted(times)[len(times) // 2],
               output_err=out_err, grad_err=grad_err, device=str(ctx.device))
    rows: list = [None] * ctx.world_size
    dist.all_gather_object(rows, row)
    return rows
