"""The ``fla`` backend's stages against the ``torch`` backend, and ``kdacp.ops.kda.chunk_kda`` against
FLA's own ``chunk_kda`` (CUDA only)."""
import pytest
import torch

from kdacp.backends.base import KDAInputs, KDAOptions, Span
from kdacp.backends.torch_backend import TorchBackend
from kdacp.ops.kda import chunk_kda
from tests.helpers import differentiable_inputs, make_kda_inputs, rel_err

pytestmark = pytest.mark.gpu


def _fla():
    from kdacp.backends.fla_adapter import fla_available, load_fla
    if not fla_available():
        pytest.skip("fla-core 0.6.0 is not installed")
    return load_fla()


def _stage_results(backend, x: KDAInputs, span: Span, h0, do, dht, head: Span):
    chunks = backend.prepare(x, span)
    states = backend.state_pass(chunks, span, h0, True)
    o = backend.output(chunks, span, h0, states)
    saved = backend.to_saved(chunks)
    summary = backend.state_summary(chunks, head, True)
    G = backend.state_gradient_summary(backend.backward_local(saved, head, do[:, head.start:head.end], h0[:1]))
    results = dict(o=o, final_state=states.final_state, S_ext=summary.offset, M=summary.transition, G=G)
    for suffix, kept in (("", None), ("_kept", states)):  # recomputed states, or the forward's
        local = backend.backward_local(saved, span, do, h0, kept)
        states = backend.backward_states(local, dht)
        grads = dict(dinitial_state=states.dinitial_state, **vars(backend.backward_inputs(states)))
        results.update({name + suffix: g for name, g in grads.items()})
    # the pass over the first segment alone (the head's message), from the backward over the whole span
    results["dinitial_state_first"] = backend.backward_states(local, dht[:1], segments=1).dinitial_state
    return results


def assert_pieces_pass_matches_whole(backend, x: KDAInputs, T: int, h0):
    """A through rank's forward: the state pass over the summary's pieces at once, each from
    :func:`~kdacp.affine.entry_states`, then the output over the whole span, against the pass along the
    whole span from ``h0 [1, HV, K, V]`` (both bf16 through the same kernels; the pieces' entry states come
    from the float32 summaries, the whole pass's from its own float32 state chain)."""
    from kdacp.affine import entry_states
    span = Span(0, T, (0, T))
    chunks = backend.prepare(x, span)
    pieces = backend.state_summary(chunks, span, True, parts=True)
    assert len(pieces.starts) > 1, pieces.starts  # the GPU-sized grid cuts this segment
    cut = backend.state_pass(chunks, span.cut(pieces.starts), entry_states(pieces, h0), True)
    whole = backend.state_pass(chunks, span, h0, True)
    assert cut.h.shape == whole.h.shape and cut.v_new.shape == whole.v_new.shape
    o_cut, o_whole = backend.output(chunks, span, h0, cut), backend.output(chunks, span, h0, whole)
    for name, a, b in (("h", cut.h, whole.h), ("v_new", cut.v_new, whole.v_new), ("o", o_cut, o_whole),
                       ("final_state", cut.final_state[-1:], whole.final_state)):
        assert rel_err(a, b) < 2e-3, (name, rel_err(a, b))
    # the mechanism is seen: every piece from h0 instead is another pass
    wrong = backend.state_pass(chunks, span.cut(pieces.starts), h0.expand(len(pieces.starts), -1, -1, -1), True)
    assert rel_err(wrong.h, whole.h) > 1e-2


# H = HV = 32, K = V = 128, bf16 as in kdacp.bench.cp# H = HV = 32, K = V = 128, bf16 as in kdacp.bench.cp: FLA autotunes every kernel per head
# shape and dtype, which takes minutes on a cold machine, so all GPU tests share one.
H, HV, K, V = 32, 32, 128, 128


@pytest.mark.parametrize("gate", ["plain", "default"])
def test_fla_stages_match_torch_stages(gate):
    _fla()
    from kdacp.backends.fla_backend import FlaBackend
    T = 300
    args = make_kda_inputs(1, T, H, HV, K, V, gate=gate, dtype=torch.bfloat16, requires_grad=False, device="cuda",
                           seed=1)
    options = KDAOptions(scale=K ** -0.5, use_qk_l2norm_in_kernel=gate != "plain", use_gate_in_kernel=gate != "plain")
    x = KDAInputs(*(args.get(n) for n in ("q", "k", "v", "g", "beta")),
                  *(args[n].float() if n in args else None for n in ("A_log", "dt_bias")))
    span, head = Span(0, T, (0, 100, T)), Span(0, 100, (0, 100))
    gen = torch.Generator(device="cuda").manual_seed(2)
    h0 = torch.randn(2, HV, K, V, device="cuda", generator=gen)
    do = torch.randn(1, T, HV, V, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(2, HV, K, V, device="cuda", generator=gen)
    x64 = KDAInputs(*(None if t is None else t.double() for t in vars(x).values()))
    ref = _stage_results(TorchBackend(options), x64, span, h0.double(), do.double(), dht.double(), head)
    got = _stage_results(FlaBackend(options), x, span, h0, do, dht, head)
    tol = 2e-2  # bf16 inputs and intermediates against the float64 reference
    for name, b in ref.items():
        a = got[name]
        assert (a is None) == (b is None), name
        assert a is None or rel_err(a, b) < tol, (name, rel_err(a, b))


def test_chunk_kda_fla_matches_fla_chunk_kda():
    fla = _fla()
    cu = torch.tensor([0, 100, 1000, 1500], device="cuda")
    args = make_kda_inputs(1, 1500, H, HV, K, V, gate="default", dtype=torch.bfloat16, initial_state=True,
                           cu_seqlens=cu, device="cuda", seed=3)
    args["initial_state"] = args["initial_state"].detach().float().requires_grad_()
    leaves = differentiable_inputs(args)
    gen = torch.Generator(device="cuda").manual_seed(4)
    do = torch.randn(1, 1500, HV, V, device="cuda", generator=gen, dtype=torch.bfloat16)
    dht = torch.randn(3, HV, K, V, device="cuda", generator=gen)
    results = []
    for fn in (lambda: chunk_kda(**args, output_final_state=True, backend="fla"),
               lambda: fla.chunk_kda(**args, output_final_state=True)):
        o, final = fn()
        grads = torch.autograd.grad((o.float() * do.float()).sum() + (final * dht).sum(), list(leaves.values()))
        results.append((o, final, grads))
    (o, final, grads), (ref_o, ref_final, ref_grads) = results
    assert rel_err(o, ref_o) < 1e-3 and rel_err(final, ref_final) < 1e-3
    for name, a, b in zip(leaves, grads, ref_grads):
        assert rel_err(a, b) < 1e-3, (name, rel_err(a, b))


def test_varlen_arguments_equal_fla_s_own():
    """The backend builds FLA's packed-sequence arguments on the host (no device sync): the same values."""
    fla = _fla()
    from kdacp.backends.fla_backend import FlaBackend
    cu = (0, 1, 64, 65, 300, 1000)
    got = FlaBackend(KDAOptions(scale=1.0))._varlen(Span(0, 1000, cu), torch.device("cuda"))
    ref_cu = torch.tensor(cu, device="cuda")
    assert torch.equal(got["cu_seqlens"], ref_cu)
    assert torch.equal(got["chunk_indices"], fla.prepare_chunk_indices(ref_cu, 64))
    # kept across calls and backends: the same tensors again, so FLA's caches keyed by them hit
    again = FlaBackend(KDAOptions(scale=1.0))._varlen(Span(0, 1000, cu), torch.device("cuda"))
    assert all(again[n] is got[n] for n in got)


def test_pieces_state_pass_matches_the_whole_pass():
    _fla()
    from kdacp.backends.fla_backend import FlaBackend
    T = 4096
    args = make_kda_inputs(1, T, H, HV, K, V, gate="default", dtype=torch.bfloat16, requires_grad=False,
                           device="cuda", seed=3, gate_shift=-4.0)
    options = KDAOptions(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         safe_gate=True, lower_bound=-5.0)
    x = KDAInputs(*(args.get(n) for n in ("q", "k", "v", "g", "beta")),
                  *(args[n].float() if n in args else None for n in ("A_log", "dt_bias")))
    h0 = torch.randn(1, HV, K, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    assert_pieces_pass_matches_whole(FlaBackend(options), x, T, h0)
