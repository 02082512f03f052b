"""The per-rank trace breakdown: compute, NCCL, blocked waits and idle gaps from kernel intervals."""
from kdacp.bench.trace import breakdown


def _k(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_breakdown_of_a_synthetic_step():
    # compute 0-100, recv spinning 50-300 (blocked 100-300), compute 300-400, gap 400-450, compute 450-500
    trace = {"traceEvents": [_k("gemm", 0, 100), _k("ncclDevKernel_Recv", 50, 250), _k("gemm", 300, 100),
                             _k("gemm", 450, 50), {"cat": "cpu_op", "name": "x", "ts": 0, "dur": 9999}]}
    b = breakdown(trace)
    assert b["step_ms"] == 0.5 and b["compute_ms"] == 0.25 and b["nccl_ms"] == 0.25
    assert b["wait_ms"] == 0.2 and b["idle_ms"] == 0.05 and b["waits"] == [(0.1, 0.2)]
    assert breakdown({"traceEvents": []}) == {}
