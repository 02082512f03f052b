"""Is one sequence's forward state pass shortened by cutting it into pieces that run side by side?

Issue 32's question for the work a rank does after its incoming state arrives. On one GPU, for KDA
(Kimi Linear's gate) and GDN (Qwen3-Next shapes) at ``T`` tokens, 32 value heads of 128, bf16: the
``fla`` backend's state pass over the whole sequence and over it cut into 2, 3, 4 and 8 pieces of whole
chunks (each with its own start state), device time (``queued_device_time``: calls queued behind a
sleep, so host launch costs do not count) and wall time per call after a sync (what a rank waiting
on nothing else sees); beside them the summary of all pieces but the last (what the cut needs while
the rank waits) and one ``M S + S_ext`` fold product. The bytes the state pass must move give its
floor at 4.8 TB/s.

    python benchmarks/state_pass_pieces.py [--seq-len 16384]

Measured (one H200, 2026-12-02, benchmarks/RESULTS.md): no. KDA's pass moves its per-channel float32
gate and every chunk's state and sits at 53% of the bandwidth; cut or not it takes 0.42 ms of device
time. GDN's drops from 0.31 to 0.21 ms, but the summary the cut needs costs 0.24-0.44 ms and each fold
product about 0.2 ms of wall time after the state arrives.
"""
from __future__ import annotations

import argparse
import time

import torch

from kdacp.affine import apply_state_summary
from kdacp.backends.base import Span
from kdacp.backends.call import prepare_call
from kdacp.bench.calibration import OPTIONS
from kdacp.bench.inputs import random_inputs
from kdacp.bench.overhead import GDN_OPTIONS
from kdacp.bench.timing import queued_device_time
from kdacp.gdn import gdn_as_kda_arguments


def _pieces(T: int, n: int, C: int) -> Span:
    """``[0, T)`` cut into ``n`` pieces of equally many whole chunks (the last may be shorter)."""
    per = -(-(-(-T // C)) // n) * C
    return Span(0, T, tuple(range(0, T, per)) + (T,))


def _wall_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def _state_pass_bytes(chunks, T: int, HV: int, K: int, V: int, C: int) -> int:
    """Reads of the keys, ``w``, ``u`` and the gate, writes of ``h`` (bf16, every chunk) and ``v_new``."""
    reads = sum(t.numel() * t.element_size() for t in (chunks.w, chunks.u))
    keys = getattr(chunks, "kg", None)
    keys = keys if keys is not None else chunks.saved.k
    gate = getattr(chunks, "gc", None)
    gate = gate if gate is not None else chunks.saved.gc
    reads += keys.numel() * keys.element_size() + gate.numel() * gate.element_size()
    writes = -(-T // C) * HV * K * V * 2 + T * HV * V * 2
    return reads + writes


def _forward_call(family: str, T: int, heads: int, D: int):
    """The ``fla`` backend's call of a forward (no gradient wanted: GDN takes FLA's GDN kernels)."""
    x = random_inputs(T, heads if family == "kda" else heads // 2, heads, D, D, gate=family, device=torch.device("cuda"))
    if family == "kda":
        return prepare_call("fla", **x, scale=None, **OPTIONS)
    gate = gdn_as_kda_arguments(x["q"], x["v"], x["g"], True, x["A_log"], x["dt_bias"])
    gate.pop("use_gate_in_kernel")
    return prepare_call("fla", x["q"], x["k"], x["v"], beta=x["beta"], **gate, scale=None, **GDN_OPTIONS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    args = parser.parse_args()
    T, heads, D = args.seq_len, 32, 128
    print("| family | pieces | state pass device ms | wall ms | floor ms | summary of all but the last piece ms "
          "| one fold product ms |")
    print("|---|---|---|---|---|---|---|")
    for family in ("kda", "gdn"):
        call = _forward_call(family, T, heads, D)
        backend, x = call.backend, call.inputs
        with torch.no_grad():
            chunks = backend.prepare(x, Span(0, T, (0, T)))
            C = backend.options.chunk_size
            floor = _state_pass_bytes(chunks, T, heads, D, D, C) / 4.8e12 * 1e3
            for n in (1, 2, 3, 4, 8):
                span = _pieces(T, n, C)
                starts = torch.randn(span.num_segments, heads, D, D, device="cuda")
                run = lambda: backend.state_pass(chunks, span, starts, False)  # noqa: E731
                device_ms = queued_device_time(run)[0] * 1e3
                summary_ms = product_ms = float("nan")
                if n > 1:
                    cu = span.cu_seqlens[:-1]
                    prefix = Span(0, cu[-1], cu)
                    summary_ms = queued_device_time(lambda: backend.state_summary(chunks, prefix, True))[0] * 1e3
                    s = backend.state_summary(chunks, prefix, True)
                    product_ms = _wall_ms(lambda: apply_state_summary(s.state[:1], s.transition[:1], starts[:1]))
                print(f"| {family} | {span.num_segments} | {device_ms:.3f} | {_wall_ms(run):.3f} | {floor:.3f} "
                      f"| {summary_ms:.3f} | {product_ms:.3f} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
