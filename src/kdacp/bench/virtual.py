"""Virtual ranks: the accuracy of each strategy's order of composition at 2 to 1024 ranks, on one device.

One long sequence is cut into ``P`` equal segments, as ``P`` ranks would hold it. Each segment's
affine summary ``(M, S_ext)`` is computed (:mod:`kdacp.reference.summary`, from the chunked
intermediates of an unsplit-equivalent pass in the compute dtype) and rounded to the message dtype
(float32), as ranks send it. Then every segment's incoming state is formed in each strategy's order
of operations, with its rounding:

- ``p2p``: hop by hop, ``x_{r+1} = M_r x_r + S_r``, rounded to float32 at every hop (the message);
- ``allgather``: each rank folds the whole chain before it from the float32 summaries;
- ``scan``: the recursive-doubling rounds of :class:`~kdacp.cp.exchanges.ScanExchange`,
  payloads rounded to float32 every round (:func:`simulate_scan`).

Every product follows :mod:`kdacp.affine`'s rule, as the strategies run it: float64 on the CPU, the
float32 kernel on a GPU.

Errors are against the incoming states of an unsplit float64 pass (``rel``: largest over segments of
``||x - x_ref|| / ||x_ref||``), and for the outputs: each segment's output from its incoming state
against the unsplit output. Measured here, on the device at hand; not a model.

    kdacp bench --suite virtual [--ranks 2,4,8] [--seq-lens 64] [--heads 2] [--head-dim 16]
"""
from __future__ import annotations

import contextlib

import torch

from kdacp import reference
from kdacp.affine import AffineMap
from kdacp.choices import VIRTUAL_CHUNK as CHUNK  # a rank's tokens are a multiple of it
from kdacp.cp.exchanges import Route, ScanExchange

from .harness import PlotSpec
from .inputs import random_inputs

PLOTS = {"virtual_error": PlotSpec(x="P", y=("p2p_state_err", "allgather_state_err", "scan_state_err"),
                                   title="incoming-state error vs ranks (virtual); where the strategies' errors "
                                         "are equal their lines lie on one another", ylabel="relative error")}
STRATEGY_ORDERS = ("p2p", "allgather", "scan")
# Ranks by device: the CPU's stop at 64 (seconds; 1024 takes minutes, mostly the float64 reference).
WORLD_SIZES = {"cpu": (2, 4, 8, 16, 64), "cuda": (2, 4, 8, 16, 64, 256, 1024)}


def simulate_scan(messages: list[AffineMap | None], emits, affine, dtype: torch.dtype = torch.float64
                  ) -> list[torch.Tensor | None]:
    """Run :class:`ScanExchange` in one process (for tests and the virtual benchmark): every position's
    incoming value, with payloads packed and rounded to ``dtype`` as the exchange sends them. ``messages``,
    ``emits`` and ``affine`` are indexed by position in the route's order. All positions are held by one
    rank, so every payload is handed over in memory: the same rounds as across ranks, no second copy."""
    emits, affine = tuple(int(e) for e in emits), tuple(bool(a) for a in affine)
    first = next((m for m in messages if m is not None), None)
    if first is None:
        return [None] * len(messages)
    shape = (max(emits + (1,)),) + tuple(first.offset.shape[1:])
    route = Route(0, None, (0,) * len(messages), emits, affine, shape, dtype, first.offset.device)
    exchange = ScanExchange()
    pending = exchange.begin(route)
    exchange.send(pending, messages)
    return exchange.receive(pending)


def incoming_states(summaries: list[AffineMap], strategy: str, wire: torch.dtype) -> list[torch.Tensor]:
    """The incoming state of segments ``1 .. P-1`` from the segments' summaries (``summaries[0]`` is
    absolute: the first segment starts the sequence), in ``strategy``'s order, messages in ``wire``."""
    P = len(summaries) + 1
    if strategy == "p2p":
        out, x = [], None
        for m in summaries:
            x = m.apply(x).to(wire)
            out.append(x)
        return out
    if strategy == "allgather":
        out = []
        for r in range(1, P):
            x = None
            for m in summaries[:r]:
                x = m.apply(x)
            out.append(x.to(wire))
        return out
    if strategy == "scan":
        emits, affine = (1,) * (P - 1) + (0,), (False,) + (True,) * (P - 2) + (False,)
        got = simulate_scan(list(summaries) + [None], emits, affine, dtype=wire)
        return [x.to(wire) for x in got[1:]]
    raise ValueError(f"strategy must be one of {STRATEGY_ORDERS}, got {strategy!r}")


@contextlib.contextmanager
def _one_thread(device: str):
    """On the CPU, one intra-op thread inside the block: the tensors are small (a few heads of 16), and more
    threads only contend, ten times slower on a busy machine."""
    if torch.device(device).type != "cpu":
        yield
        return
    former = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(former)


def run(world_sizes=None, tokens_per_rank: int = CHUNK, HV: int = 2, K: int = 16, V: int = 16, seed: int = 0,
        device: str = "cpu", report=None) -> list[dict]:
    """Rows ``P, T`` and per strategy ``<s>_state_err`` (incoming states) and ``<s>_output_err``.

    ``world_sizes``: the rank counts ``P`` (default :data:`WORLD_SIZES` of the device's type);
    ``tokens_per_rank`` is a multiple of the chunk size (:data:`CHUNK`), so that rank edges are chunk edges and
    the unsplit pass's per-chunk states are the true incoming states; ``HV`` heads of ``K x V``."""
    if tokens_per_rank % CHUNK:
        raise ValueError(f"tokens_per_rank must be a multiple of the chunk size {CHUNK}, got {tokens_per_rank}")
    if world_sizes is None:
        world_sizes = WORLD_SIZES[torch.device(device).type]
    with _one_thread(device):
        return _rows(world_sizes, tokens_per_rank, HV, K, V, seed, device, report)


def _rows(world_sizes, tokens_per_rank: int, HV: int, K: int, V: int, seed: int, device: str, report) -> list[dict]:
    rows = []
    for P in world_sizes:
        T = P * tokens_per_rank
        # Kimi Linear's safe gate (decays in [exp(-5), 1)), L2-normalised q/k: the settings people train.
        args = dict(random_inputs(T, HV, HV, K, V, dtype=torch.float64, device=device, seed=seed),
                    use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, lower_bound=-5.0)
        cu = torch.arange(0, T + 1, tokens_per_rank, device=device)
        # Segment-local chunked intermediates and the summaries ranks would send (float32 on the wire).
        inter = reference.chunk_kda_intermediates(**args, cu_seqlens=cu)
        S, M = reference.state_summary(inter.kg, inter.w, inter.u, inter.gc, cu_seqlens=cu)
        wire = torch.float32
        msgs = [AffineMap(S[0:1].to(wire))] + [AffineMap(S[r:r + 1].to(wire), M[r:r + 1].to(wire))
                                               for r in range(1, P - 1)]
        # The truth: one unsplit float64 pass, with its state at every segment edge.
        whole = reference.chunk_kda_intermediates(**args)
        o_ref, per_rank = whole.o, tokens_per_rank // CHUNK
        truth = [whole.h[0, r * per_rank][None] for r in range(1, P)]
        row = dict(P=P, T=T)
        for strategy in STRATEGY_ORDERS:
            states = incoming_states(msgs, strategy, wire)
            row[f"{strategy}_state_err"] = max(((x.double() - t).norm() / t.norm()).item()
                                               for x, t in zip(states, truth))
            h0 = torch.cat([torch.zeros_like(truth[0])] + [x.double() for x in states])
            o, _ = reference.chunk_kda(**args, cu_seqlens=cu, initial_state=h0)
            row[f"{strategy}_output_err"] = ((o - o_ref).norm() / o_ref.norm()).item()
        rows.append(row)
        if report is not None:
            report(row)
    return rows
