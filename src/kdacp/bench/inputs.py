"""The random op inputs every suite times and checks: one packed row of raw ``chunk_kda`` / ``chunk_gated_delta_rule``
arguments, as Kimi Linear (KDA) or Qwen3-Next (GDN) feed them with the gate computed in the kernel."""
from __future__ import annotations

import torch

GATES = ("kda", "gdn")


def random_inputs(T: int, H: int, HV: int, K: int, V: int, *, gate: str = "kda", dtype: torch.dtype = torch.bfloat16,
                  device="cuda", seed: int = 0, leaves: bool = False) -> dict:
    """One row of ``T`` tokens, drawn on ``device`` from ``seed`` (float32 draws, float64 for ``dtype`` float64).

    Returns:
        ``q, k [1, T, H, K]``, ``v [1, T, HV, V]`` and the raw gate logits ``g`` in ``dtype`` (``[1, T, HV, K]``
        per channel for ``gate="kda"``, ``[1, T, HV]`` per head for ``"gdn"``); ``beta [1, T, HV]`` (a sigmoid)
        in ``dtype``; ``A_log [HV]`` and ``dt_bias`` (``[HV * K]`` KDA, ``[HV]`` GDN) in the draws' dtype:
        KDA's ``0.5 * N(0, 1)`` each, GDN's ``A_log = log U(1, 16)`` (Qwen3-Next's initialisation).
        ``leaves``: each tensor a leaf that requires grad.
    """
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    draw = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=draw, device=device).to(dt)

    x = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, HV, V),
             g=rnd(1, T, HV, K) if gate == "kda" else rnd(1, T, HV))
    x["beta"] = torch.sigmoid(rnd(1, T, HV, dt=draw)).to(dtype)
    if gate == "kda":
        x.update(A_log=0.5 * rnd(HV, dt=draw), dt_bias=0.5 * rnd(HV * K, dt=draw))
    else:
        x.update(A_log=torch.rand(HV, generator=gen, dtype=draw, device=device).mul(15).add(1).log(),
                 dt_bias=0.5 * rnd(HV, dt=draw))
    return {n: t.requires_grad_() for n, t in x.items()} if leaves else x
