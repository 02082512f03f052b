"""The ``fla`` backend hands FLA's stage kernels dense tensors (CPU; FLA replaced by a recorder).

FLA's kernels index memory as if every tensor were contiguous; a strided view (a permuted
activation, a chunk of a gathered state gradient) must be copied before it reaches them.
"""
import torch

from kdacp.backends.base import KDAInputs, KDAOptions, Span
from kdacp.backends.fla_backend import FlaBackend


class RecordingFla:
    """Records, per FLA function called, whether each tensor argument was contiguous."""

    RCP_LN2 = 1.4426950408889634

    def __init__(self):
        self.calls = []

    def _record(self, name, kwargs, *args):
        tensors = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
        self.calls.append((name, {k: v.is_contiguous() for k, v in tensors.items() if isinstance(v, torch.Tensor)}))

    def l2norm_fwd(self, x):
        self._record("l2norm_fwd", {}, x)
        return x.contiguous(), x.new_ones(x.shape[:-1])

    def kda_gate_chunk_cumsum(self, **kw):
        self._record("kda_gate_chunk_cumsum", kw)
        return kw["g"].float().contiguous()

    def chunk_kda_fwd_intra(self, **kw):
        self._record("chunk_kda_fwd_intra", kw)
        k, v = kw["k"], kw["v"]
        A = k.new_zeros(*k.shape[:3], kw["chunk_size"], dtype=torch.float32)
        return k.clone(), v.clone(), None, k.clone(), A, A.clone()

    def chunk_gated_delta_rule_bwd_dhu(self, **kw):
        self._record("chunk_gated_delta_rule_bwd_dhu", kw)
        return None, kw["dht"], kw["dv"]


def test_strided_inputs_and_state_gradients_reach_fla_contiguous():
    T, H, K = 64, 2, 16
    options = KDAOptions(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                         safe_gate=True)
    backend = FlaBackend.__new__(FlaBackend)
    backend.options, backend.fla = options, RecordingFla()
    # head-first storage seen token-first, as a permuted activation arrives
    q, k, v, g = (torch.randn(1, H, T, K).transpose(1, 2) for _ in range(4))
    beta = torch.rand(1, H, T).transpose(1, 2)
    A_log, dt_bias = torch.randn(2 * H)[::2], torch.randn(H * K, 2)[:, 0]  # strided parameter views
    assert not any(t.is_contiguous() for t in (q, k, v, g, beta, A_log, dt_bias))
    backend.prepare(KDAInputs(q, k, v, g, beta, A_log, dt_bias), Span(0, T, (0, T)))
    dht = torch.randn(2, 2 * H, K, K).chunk(2, dim=1)[1]  # a head chunk of gathered state gradients
    assert not dht.is_contiguous()
    local = type("Local", (), dict(qg=q, kg=k, w=k, gc=g, initial_state=None, do=v, dv_local=v, varlen={},
                                        span=Span(0, T, (0, T))))()
    backend.backward_states(local, dht)
    names = [name for name, _ in backend.fla.calls]
    assert names == ["l2norm_fwd", "l2norm_fwd", "kda_gate_chunk_cumsum", "chunk_kda_fwd_intra",
                     "chunk_gated_delta_rule_bwd_dhu"]
    strided = {(name, arg) for name, layout in backend.fla.calls for arg, dense in layout.items() if not dense}
    # the recorder's own stand-ins for intermediate results are not under test
    strided -= {("chunk_gated_delta_rule_bwd_dhu", a) for a in ("q", "k", "w", "gk", "do", "dv")}
    assert not strided, f"strided tensors reached FLA: {sorted(strided)}"


def test_segments_of_a_backward_are_views_of_their_rows():
    """``backward_states(..., segments=n)`` and ``state_gradient_summary(..., segments=(a, b))`` run on ``local``
    cut to some of its segments: token rows of those segments, ``h`` of their chunks, their initial states, FLA's
    packed-sequence arguments of the cut."""
    from kdacp.backends.fla_backend import FlaBackward, FlaSaved
    backend = FlaBackend.__new__(FlaBackend)
    backend.options = KDAOptions(scale=1.0, chunk_size=4)
    cu, T, HV, K = (0, 6, 9, 20), 20, 2, 4  # 2 + 1 + 3 chunks of 4
    tok = lambda: torch.randn(1, T, HV, K)  # noqa: E731
    saved = FlaSaved(*(tok() for _ in range(4)), None, tok(), tok(), tok(), None, None, torch.randn(HV), None)
    span = Span(10, 30, cu)
    local = FlaBackward(saved, span, backend._varlen(span, torch.device("cpu")), tok(), torch.randn(3, HV, K, K),
                        *(tok() for _ in range(3)), tok(), torch.randn(1, 6, HV, K, K), *(tok() for _ in range(3)))
    # (first, last, span, its FLA boundaries and chunk indices, h's chunks, token rows)
    for first, last, want, bounds, indices, chunks, tokens in (
            (0, 2, Span(10, 19, (0, 6, 9)), [0, 6, 9], [[0, 0], [0, 1], [1, 0]], slice(0, 3), slice(0, 9)),
            (1, 3, Span(16, 30, (0, 3, 14)), [0, 3, 14], [[0, 0], [1, 0], [1, 1], [1, 2]], slice(2, 6),
             slice(6, 20))):
        part = backend._segments(local, first, last)
        assert part.span == want
        assert part.varlen["cu_seqlens"].tolist() == bounds
        assert part.varlen["chunk_indices"].tolist() == indices
        assert torch.equal(part.h, local.h[:, chunks])
        assert torch.equal(part.initial_state, local.initial_state[first:last])
        for name in ("do", "gc", "w", "qg", "kg", "v_new", "dAqk", "dv_local"):
            assert torch.equal(getattr(part, name), getattr(local, name)[:, tokens]), name
        for name in ("q", "k", "v", "beta", "gc", "Aqk", "Akk"):
            assert torch.equal(getattr(part.saved, name), getattr(saved, name)[:, tokens]), name
        assert part.saved.A_log is saved.A_log and part.saved.g is None
    assert backend._segments(local, 0, 3) is local
    one = backend._segments(local, 0, 1)  # one segment: FLA's unpacked path
    assert one.varlen == dict(cu_seqlens=None, chunk_indices=None) and one.h.shape[1] == 2
