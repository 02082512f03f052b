"""``kdacp demo``: a few training steps of a tiny Hugging Face Kimi Linear model under
:func:`kdacp.parallelize`, checked against the unmodified model in one process.

Every rank holds the whole model and an equal time shard of one long packed batch
(:func:`kdacp.shard_batch`; documents are cut across ranks at arbitrary points). Each step runs forward
and backward on the shards with the global token-mean loss (:func:`kdacp.integrations.transformers.global_token_mean_loss`),
sums the parameter gradients over the ranks and takes an SGD step. Rank 0 also runs the reference: the
unmodified model (a float32 copy of the same initial weights), one document at a time (transformers'
CPU fallbacks ignore packed-sequence boundaries, so one document at a time is the model's meaning),
and broadcasts its logits, loss and gradients; every rank compares its own logits and the summed
gradients with them. The reference runs transformers' own PyTorch code on every device
(:func:`kdacp.integrations.transformers.torch_fallbacks`): an implementation independent of the kernels under test, and on
CUDA no Triton compiling or FLA autotuning of float32 shapes (which took most of a first run's 115 s on
one H200).

Every rank times what it spends on (:data:`PHASES`), so that the command can report where its wall time
went.
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .backends import needs_cuda, resolve_backend
from .choices import DEMO_DTYPES as DTYPES
from .cp import build_cp_plan, new_cp_group
from .cp import ContextParallel
from .cp.context import MODES, hybrid_ulysses_size
from .integrations.transformers import global_token_mean_loss, load_kimi_linear, parallelize, shard_batch, torch_fallbacks
from .precompilation import precompile
from .workers import WorkerRank

__all__ = ["DTYPES", "DemoConfig", "PHASES", "demo_batch", "demo_config", "demo_model", "demo_step", "demo_worker",
           "plural"]


# Largest relative error (norm-wise) accepted between the context-parallel run and the float32 reference.
# float32: the reference is transformers' own code, kdacp's a different summation order of the same math;
# measured about 4e-6 on the gradients (CPU, 1 to 4 ranks), so 2e-5 leaves room for other seeds and sizes
# (tests/models uses the same bound). On CUDA, float32 products run in TF32 (Triton's default for FLA's
# kernels, cuDNN's for the reference's convolution), 10 mantissa bits: 1e-2, not yet measured on a GPU.
# bfloat16: the run's own rounding against the float32 reference, measured up to 3.8e-2 in the gradients
# (CPU, 2 ranks, the default batch), while removing the
# convolution halo, the state exchange or the MLA's document mask gives 0.17, 0.32 and 0.70: 1e-1 between.
# Float64 is not offered: transformers' Kimi Linear computes in float32 inside whatever the weights.
TOLERANCE = {("cpu", "float32"): 2e-5, ("cuda", "float32"): 1e-2, ("cpu", "bfloat16"): 1e-1,
             ("cuda", "bfloat16"): 1e-1}
# The decoder's token mixers: KDA, MLA (full attention, under Ulysses), KDA. The MLPs are dense: a mixture
# of experts picks each token's experts by a top-k choice, which bf16 rounding flips for near ties, so a bf16
# run could not be held to the float32 reference (measured: 9e-2 in the router's gradient); it works per
# token and parallelize leaves it alone (tests/models checks it under parallelize).
LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention")
# the KDA layers' short convolution width (Kimi Linear's)
CONV_SIZE = 4

# What a rank's time goes to, in seconds (a row's ``<phase>_s``): building the model, its copy and the
# parallelisation; the context-parallel steps (the first one's ``precompile`` and ``autotune`` included);
# the one-process reference (rank 0; the other ranks wait for it in ``checks``); broadcasting the
# reference and comparing with it, and the optimizer steps.
PHASES = ("build", "steps", "reference", "checks")


def plural(n: int, noun: str) -> str:
    """``n`` ``noun`` s: ``"1 rank"``, ``"4 ranks"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs; ``seq_lens`` must add up to a multiple of ``world_size``, and ``num_heads``
    (KDA and MLA layers alike) be a multiple of it (:func:`demo_config` picks sizes that fit)."""

    world_size: int = 4
    seq_lens: tuple[int, ...] = (600, 250, 900, 298)
    mode: str = "state"
    strategy: str = "p2p"
    ulysses_size: int | None = None
    backend: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    steps: int = 3
    hidden_size: int = 64
    num_heads: int = 4
    head_dim: int = 16
    vocab_size: int = 256
    lr: float = 0.05
    seed: int = 0
    precompile: bool = True

    @property
    def tolerance(self) -> float:
        """The largest relative error accepted for this device and dtype (see :data:`TOLERANCE`)."""
        return TOLERANCE[self.device, self.dtype]

    @property
    def ulysses_ranks(self) -> int | None:
        """Ranks that split each KDA layer's heads: 1 (state), ``world_size`` (ulysses), ``ulysses_size`` (hybrid)."""
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
        state_ranks = P // U
        if state_ranks > 1 and T // state_ranks < CONV_SIZE - 1:
            raise ValueError(f"the sequence lengths add up to {T} tokens, {T // state_ranks} for each of the {state_ranks} "
                             f"ranks of the state exchange, fewer than the {CONV_SIZE - 1} the short convolution "
                             f"(width {CONV_SIZE}) takes from the previous rank; make the total at least "
                             f"{state_ranks * (CONV_SIZE - 1)}")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"--head-dim must be even and >= 2 (the MLA layers' qk_rope_head_dim is half of it), "
                             f"got {self.head_dim}")
        if self.num_heads < 1 or self.num_heads % P:
            raise ValueError(f"--heads must be a positive multiple of --world-size {P}, got {self.num_heads}: the MLA "
                             f"layers' Ulysses attention splits every layer's heads over all {P} ranks")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if needs_cuda(self.backend) and self.device != "cuda":
            raise ValueError(f"--backend {self.backend} needs --device cuda (its kernels are CUDA-only), got --device "
                             f"{self.device}; use --backend torch or auto")
        if needs_cuda(self.backend):
            try:
                resolve_backend(self.backend, torch.device(self.device))
            except (ImportError, ValueError) as e:
                raise ValueError(f"--backend {self.backend}: {e}") from None

    def memory_bytes(self) -> int:
        """A lower bound of the bytes one rank holds at its peak, from the sizes alone (for refusing sizes that
        cannot fit before any worker starts): the reference's float32 logits of the whole batch, which rank 0
        broadcasts to every rank (``[T, vocab]``); the weights of the model and of its float32 reference with
        their gradients, counting only the KDA layers' q, k, v and output projections and the MLA layers'
        query and output projections (``hidden x heads x head_dim`` each) and the embedding and output
        layer; and the saved inputs q, k, v and gate of the KDA layers for the rank's tokens."""
        T, (d, H, K) = sum(self.seq_lens), (self.hidden_size, self.num_heads, self.head_dim)
        width = 2 if self.dtype == "bfloat16" else 4
        kda_layers = LAYER_TYPES.count("linear_attention")
        params = (4 * kda_layers + 2 * (len(LAYER_TYPES) - kda_layers)) * d * H * K + 2 * self.vocab_size * d
        return (4 * T * self.vocab_size + params * 2 * (width + 4)
                + 4 * kda_layers * (T // self.world_size) * H * K * width)

    def describe(self) -> str:
        """One line naming what runs: ranks, mode, strategy (where state is passed), model, dtype."""
        how = {"state": f"strategy {self.strategy}", "ulysses": "all-to-all over heads, no state passing",
               "hybrid": f"ulysses_size {self.ulysses_size}, strategy {self.strategy}"}[self.mode]
        layers = ", ".join({"linear_attention": "KDA", "full_attention": "MLA"}[t] for t in LAYER_TYPES)
        return (f"{plural(self.world_size, 'rank')}, mode {self.mode} ({how}), Kimi Linear ({layers}; {self.num_heads} heads "
                f"of {self.head_dim}), {self.dtype}, backend {self._backend_text()}, {plural(self.steps, 'step')}")

    def _backend_text(self) -> str:
        """The backend, and for ``auto`` what the model's KDA layers resolve to on the device
        (:func:`resolve_backend`)."""
        if self.backend != "auto":
            return self.backend
        return f"auto ({resolve_backend(self.backend, torch.device(self.device))})"


# Head sizes by device: small on CPU (seconds per step); on CUDA Kimi Linear's own (32 heads of 128), the
# sizes the FLA kernel configurations shipped for the H100 and the H200 were tuned at, so that the first step can find
# them instead of autotuning (whether every kernel's key matches shows in that step's time).
HEADS = {"cpu": (4, 16), "cuda": (32, 128)}


def demo_config(world_size: int, mode: str = "state", *, ulysses_size: int | None = None,
                num_heads: int | None = None, head_dim: int | None = None, device: str = "cpu",
                **options) -> DemoConfig:
    """A :class:`DemoConfig` whose unset sizes fit ``world_size`` and ``device``; check it with ``validate()``.

    ``ulysses_size`` (hybrid): the smallest divisor of ``world_size`` between 1 and itself (None if
    there is none). ``num_heads`` and ``head_dim``: :data:`HEADS` of the device, the heads raised to
    ``world_size``'s smallest multiple from there where they do not split over the ranks.
    """
    if mode == "hybrid" and ulysses_size is None:
        ulysses_size = hybrid_ulysses_size(world_size)
    heads, dim = HEADS.get(device, HEADS["cpu"])
    if num_heads is None:
        num_heads = -(-heads // world_size) * world_size
    return DemoConfig(world_size=world_size, mode=mode, ulysses_size=ulysses_size, num_heads=num_heads,
                      head_dim=dim if head_dim is None else head_dim, device=device, **options)


def demo_model(cfg: DemoConfig, device=None) -> nn.Module:
    """The demo's transformers ``KimiLinearForCausalLM``, float32, with weights from ``cfg.seed``.

    Sizes from ``cfg``: ``hidden_size``, ``num_heads`` heads of ``head_dim`` in the KDA layers and in the
    MLA layers (``qk_nope_head_dim``, ``v_head_dim`` and ``kv_lora_rank`` ``head_dim``, ``qk_rope_head_dim``
    half of it), layers :data:`LAYER_TYPES` with dense MLPs, attention ``sdpa``. The RMSNorm weights are
    moved off their all-ones start, so that their gradients are checked on something general.
    """
    kl = load_kimi_linear()
    d, H, K = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    config = kl.KimiLinearConfig(
        vocab_size=cfg.vocab_size, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES), mlp_layer_types=["dense"] * len(LAYER_TYPES),
        num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=K, q_lora_rank=None, qk_nope_head_dim=K,
        qk_rope_head_dim=K // 2, v_head_dim=K, linear_num_heads=H, linear_head_dim=K, linear_conv_kernel_dim=CONV_SIZE,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
        attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    model = kl.KimiLinearForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    return model.to(device)


def demo_batch(cfg: DemoConfig, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global packed batch of a step: token ids ``[1, T]`` (new ones per step) and ``cu_seqlens [N+1]``."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    ids = torch.randint(cfg.vocab_size, (1, sum(cfg.seq_lens)), generator=gen)
    cu = torch.tensor([0, *torch.tensor(cfg.seq_lens).cumsum(0).tolist()])
    return ids.to(device), cu.to(device)


def demo_step(model: nn.Module, ids: torch.Tensor, cu_seqlens: torch.Tensor,
              group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of a parallelised model on this rank's shard of the global batch ``ids [1, T]``
    (documents ``cu_seqlens [N+1]``); leaves every parameter's gradient summed over ``group``'s ranks
    (the gradient of the global token mean). Returns this rank's logits ``[1, T/P, vocab]`` and the
    global token-mean loss, detached."""
    batch = shard_batch(ids, cu_seqlens=cu_seqlens, group=group)
    kwargs = batch.model_kwargs()
    del kwargs["labels"]  # the loss below sums the gradients (global_token_mean_loss), not the model's own
    logits = model(**kwargs).logits
    loss = global_token_mean_loss(logits, batch.labels, group=group)
    loss.backward()
    _collective_over_grads(model, dist.all_reduce, group=group)
    return logits.detach(), loss.detach()


def _collective_over_grads(model: nn.Module, collective, **kwargs) -> None:
    """Run ``collective`` (``dist.all_reduce``, ``dist.broadcast``) on all parameter gradients at once,
    flattened per dtype: one collective instead of one per parameter."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.flatten() for g in grads])
        collective(flat, **kwargs)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _reference_step(model: nn.Module, ids: torch.Tensor, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The unmodified model's logits ``[1, T, vocab]`` (float32) and global token-mean loss, one
    document at a time; leaves the parameters' gradients."""
    # transformers' PyTorch code: where FLA imports, transformers calls FLA's kernels on any device (on CPU
    # they fail; on CUDA they compile and autotune float32 shapes for minutes on a fresh machine).
    with torch_fallbacks():
        logits = [model(input_ids=ids[:, s:e], use_cache=False).logits.float() for s, e in zip(cu[:-1], cu[1:])]
    total = sum(F.cross_entropy(lg[0, :-1], ids[0, s + 1:e], reduction="sum") for lg, s, e in zip(logits, cu, cu[1:]))
    loss = total / (cu[-1] - len(cu) + 1)
    loss.backward()
    return torch.cat(logits, dim=1).detach(), loss.detach()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _autotune_clock(spent: dict):
    """Inside the block, ``spent["autotune"]`` gathers the wall seconds of Triton's autotuning: every
    ``Autotuner._bench`` call (compiling and timing one candidate configuration; FLA's ``CachedAutotuner``
    is one)."""
    from triton.runtime.autotuner import Autotuner
    real = Autotuner._bench

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            spent["autotune"] += time.perf_counter() - t0
    Autotuner._bench = timed
    try:
        yield
    finally:
        Autotuner._bench = real


def _strategy(cfg: DemoConfig, cp: ContextParallel) -> str:
    """The state exchange of the run's plans: ``"none"`` without state passing, else the strategy and, for
    ``auto``, the cost model's reason (the layers build the same plan per batch)."""
    if cp.state_size == 1:
        return "none"
    cu = [0, *torch.tensor(cfg.seq_lens).cumsum(0).tolist()]
    plan = build_cp_plan(cu, local_lengths=[cu[-1] // cp.state_size] * cp.state_size, group=cp.state_group,
                         strategy=cfg.strategy)
    return plan.strategy if plan.strategy_reason == "given" else f"{plan.strategy} ({plan.strategy_reason})"


def demo_worker(worker: WorkerRank, cfg: DemoConfig) -> list[dict]:
    """One rank of the demo; returns every rank's row (gathered), so rank 0 can print the table.

    A row: ``rank, device, tokens, sequences``; ``first_s`` (the first step, its ``precompile_s`` and
    ``autotune_s`` included), ``later_ms`` (mean; None after one step); ``output_err, loss_err, grad_err``; ``losses``;
    ``strategy`` (:func:`_strategy`); ``<phase>_s`` of :data:`PHASES` and ``worker_s`` (this function's
    whole time), in seconds; ``started_at``: when this function began (``time.time()``, comparable across
    the processes of one machine)."""
    started_at, start = time.time(), time.perf_counter()
    spent = dict.fromkeys(("build", "steps", "reference", "checks", "precompile", "autotune"), 0.0)
    with _autotune_clock(spent):
        row = _train_and_check(worker, cfg, spent)
    row.update({f"{name}_s": spent[name] for name in spent}, worker_s=time.perf_counter() - start,
               started_at=started_at)
    rows: list = [None] * worker.world_size
    dist.all_gather_object(rows, row)
    return rows


def _train_and_check(worker: WorkerRank, cfg: DemoConfig, spent: dict) -> dict:
    """:func:`demo_worker`'s run: this rank's row, less its times, which go into ``spent`` (seconds)."""
    t0 = time.perf_counter()
    from transformers.utils import logging
    logging.set_verbosity_error()  # the reference's notices that it runs transformers' PyTorch fallbacks
    model = demo_model(cfg, worker.device)
    reference = copy.deepcopy(model)  # float32, the same initial weights
    model.to(getattr(torch, cfg.dtype))
    cp = ContextParallel(cfg.mode, new_cp_group(), strategy=cfg.strategy, ulysses_size=cfg.ulysses_size,
                            backend=cfg.backend)
    parallelize(model, cp)
    strategy = _strategy(cfg, cp)
    optimizers = [torch.optim.SGD(m.parameters(), lr=cfg.lr) for m in (model, reference)]
    _sync(worker.device)
    spent["build"] = time.perf_counter() - t0
    T = sum(cfg.seq_lens)
    T_local = T // worker.world_size
    shard = slice(worker.rank * T_local, (worker.rank + 1) * T_local)
    errors = dict(output_err=0.0, loss_err=0.0, grad_err=0.0)
    times, losses = [], []
    compiled = 0
    for step in range(cfg.steps):
        ids, cu = demo_batch(cfg, step, worker.device)
        _sync(worker.device)
        t0 = time.perf_counter()
        if step == 0 and cfg.precompile:  # part of the first step's time
            compiled = precompile(lambda: demo_step(model, ids, cu, cp.group), device=worker.device)
            model.zero_grad(set_to_none=True)  # the dry run's garbage
            _sync(worker.device)
            spent["precompile"] = time.perf_counter() - t0
        logits, loss = demo_step(model, ids, cu, cp.group)
        _sync(worker.device)
        times.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        ref_logits = torch.empty(1, T, cfg.vocab_size, device=worker.device)
        ref_loss = torch.empty((), device=worker.device)
        if worker.rank == 0:
            ref_logits, ref_loss = _reference_step(reference, ids, cu.tolist())
            _sync(worker.device)
            spent["reference"] += time.perf_counter() - t0
            t0 = time.perf_counter()
        else:
            for p in reference.parameters():
                p.grad = torch.empty_like(p)
        for t in (ref_logits, ref_loss):
            dist.broadcast(t, 0)
        _collective_over_grads(reference, dist.broadcast, src=0)
        pairs = zip(model.parameters(), reference.parameters())
        for name, err in (("output_err", _rel_err(logits, ref_logits[:, shard])),
                          ("loss_err", _rel_err(loss, ref_loss)),
                          ("grad_err", max(_rel_err(p.grad, r.grad) for p, r in pairs))):
            errors[name] = max(errors[name], err)
        losses.append(loss.item())
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(worker.device)
        spent["checks"] += time.perf_counter() - t0
        worker.report(("step", step + 1))
    spent["steps"] = sum(times)

    cu_list = [0, *torch.tensor(cfg.seq_lens).cumsum(0).tolist()]
    pieces = sum(1 for a, b in zip(cu_list[:-1], cu_list[1:]) if a < shard.stop and b > shard.start)
    later = times[1:]
    return dict(rank=worker.rank, tokens=T_local, sequences=pieces, first_s=times[0], precompiled=compiled,
                later_ms=1e3 * sum(later) / len(later) if later else None, **errors, losses=losses,
                device=str(worker.device), strategy=strategy)
