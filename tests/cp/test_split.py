"""The split inside one device (:mod:`kdacp.cp.split`) against the float64 reference: long sequences
cut into S = 2..7 pieces with piece and segment ends off chunk boundaries, packed documents of every size class,
initial and final states, grouped value heads, KDA and GDN; and under context parallelism at P = 2 and 3 over
contiguous ranks (a through rank, ranks without a tail) and zigzag (ranks of two positions). Every output, final
state and gradient at 1e-9; each test also checks that the cut ran (the chain of pieces is walked both ways), so
that a split silently declined cannot pass for an exact one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kdacp.cp.split as split_module
from kdacp import reference
from kdacp.affine import AffineMap, chain_states
from kdacp.backends.base import KDAOptions, Span
from kdacp.backends.torch_backend import TorchBackend
from kdacp.cp.split import check_split, chunks_per_piece
from kdacp.ops.gdn import chunk_gated_delta_rule
from kdacp.ops.kda import chunk_kda
from kdacp.reference.gdn import recurrent_gated_delta_rule
from tests.cp.test_cp_layouts import check_layout_case
from tests.helpers import make_kda_inputs, rel_err
from tests.multiprocess import run_ranks
from tests.test_gdn import gdn_inputs

# a token, shorter than a chunk, a few chunks with a partial last one, one long document with a partial last chunk
DOCS = (0, 1, 40, 250, 700)


@pytest.fixture
def chain_walks(monkeypatch):
    """The directions (``reverse``) :func:`chain_states` was called with by the split."""
    walks = []

    def spy(maps, counts, initial, reverse=False):
        walks.append(reverse)
        return chain_states(maps, counts, initial, reverse)

    monkeypatch.setattr(split_module, "chain_states", spy)
    return walks


def _inputs(op: str, seed: int) -> dict:
    cu = torch.tensor(DOCS)
    if op == "kda":
        args = make_kda_inputs(1, DOCS[-1], 1, 2, 16, 16, gate="default", initial_state=True, cu_seqlens=cu,
                               seed=seed, gate_shift=-4.0)
    else:
        args = gdn_inputs(1, DOCS[-1], 1, 2, 16, 16, gate_in_kernel=False, cu=list(DOCS), init=True, seed=seed)
        gen = torch.Generator().manual_seed(seed + 1)
        args["g"] = F.logsigmoid(torch.randn(args["g"].shape, generator=gen, dtype=torch.float64) + 4.0)
        args["g"].requires_grad_()
    args["cu_seqlens"] = cu
    return args


def _run(op: str, args: dict, do: torch.Tensor, dfinal: torch.Tensor, **kwargs):
    leaves = {n: x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.requires_grad else x
              for n, x in args.items()}
    if op == "kda":
        o, final = chunk_kda(**leaves, output_final_state=True, **kwargs)
    else:
        o, final = chunk_gated_delta_rule(**leaves, output_final_state=True, **kwargs)
    names = [n for n, x in leaves.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = torch.autograd.grad((o * do).sum() + (final * dfinal).sum(), [leaves[n] for n in names])
    return o, final, dict(zip(names, grads))


@pytest.mark.parametrize("op", ["kda", "gdn"])
# S = 2 and 7 (the fewest pieces, and the most: the 11-chunk document in pieces of 2 chunks); 3 and 5 with -m slow
@pytest.mark.parametrize("pieces", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(5, marks=pytest.mark.slow), 7])
def test_one_device_split_matches_reference(op, pieces, chain_walks):
    args = _inputs(op, seed=10 * pieces + (op == "gdn"))
    gen = torch.Generator().manual_seed(pieces)
    do = torch.randn(args["v"].shape, generator=gen, dtype=torch.float64)
    dfinal = torch.randn(args["initial_state"].shape, generator=gen, dtype=torch.float64)
    ref_args = {n: x for n, x in args.items()}
    if op == "kda":
        ref_o, ref_final = reference.chunk_kda(**ref_args, output_final_state=True)
    else:
        ref_o, ref_final = recurrent_gated_delta_rule(**ref_args, output_final_state=True)
    names = [n for n, x in args.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    ref_grads = torch.autograd.grad((ref_o * do).sum() + (ref_final * dfinal).sum(), [args[n] for n in names])
    o, final, grads = _run(op, args, do, dfinal, backend="torch", split=pieces)
    assert chain_walks.count(False) == 1 and chain_walks.count(True) == 1, chain_walks
    assert rel_err(o, ref_o) < 1e-9, rel_err(o, ref_o)
    assert rel_err(final, ref_final) < 1e-9, rel_err(final, ref_final)
    for n, want in zip(names, ref_grads):
        assert rel_err(grads[n], want) < 1e-9, f"d{n}: {rel_err(grads[n], want):.2e}"


def test_pieces_of_the_longest_segment():
    backend = TorchBackend(KDAOptions(scale=0.25))
    span = Span(0, 700, (0, 40, 700))  # the longest: 660 tokens, 11 chunks of 64
    cpu = torch.device("cpu")
    assert chunks_per_piece(3, backend, span, 2, 16, 16, cpu) == 4
    assert chunks_per_piece(11, backend, span, 2, 16, 16, cpu) == 1
    assert chunks_per_piece(1, backend, span, 2, 16, 16, cpu) is None
    assert chunks_per_piece(None, backend, span, 2, 16, 16, cpu) is None
    assert chunks_per_piece(12, backend, Span(0, 40, (0, 40)), 2, 16, 16, cpu) is None  # one chunk: no cut
    assert chunks_per_piece("auto", backend, span, 2, 16, 16, cpu) is None  # auto cuts on a GPU only


@pytest.mark.parametrize("heads, pieces", [(2, 16), (4, 16), (8, 8), (16, 4), (32, None)])
def test_auto_pieces_on_an_h100_where_they_measured_best(heads, pieces):
    """``split="auto"`` for one sequence of 64K tokens (K = V = 128) on the 132 SMs of an H100: the piece counts
    that measured best or within 5% of it there (benchmarks/RESULTS.md, Split inside one GPU), none at 32 heads,
    where the state pass fills the GPU; at 2 heads capped at 16 pieces (32 measured slower)."""
    length = split_module.auto_chunks_per_piece(Span(0, 65536, (0, 65536)), heads, 128, 128, 64, sms=132)
    assert (None if length is None else -(-1024 // length)) == pieces
    uneven = split_module.auto_chunks_per_piece(Span(0, 65000, (0, 100, 65000)), heads, 128, 128, 64, sms=132)
    assert (None if uneven is None else -(-1015 // uneven)) == pieces  # the longest segment is cut the same


def test_auto_never_cuts_inside_a_cuda_graph_capture(monkeypatch):
    """A cut call's forward + backward failed to capture on an H100: inside a capture ``"auto"`` declines the cut
    (an int still cuts: the caller's choice); outside it the same call on the same GPU is cut."""
    backend = TorchBackend(KDAOptions(scale=0.25))
    span = Span(0, 65536, (0, 65536))
    cuda = torch.device("cuda")
    monkeypatch.setattr(split_module, "sm_count", lambda device: 132)  # an H100, on a machine without one
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert chunks_per_piece("auto", backend, span, 4, 128, 128, cuda) == 64  # 16 pieces of the 1,024 chunks
    capturing[0] = True
    assert chunks_per_piece("auto", backend, span, 4, 128, 128, cuda) is None
    assert chunks_per_piece(8, backend, span, 4, 128, 128, cuda) == 128


@pytest.mark.parametrize("tokens, cut", [(8192, False), (16383, False), (16384, True), (32768, True)])
def test_auto_leaves_short_segments_whole(tokens, cut):
    """Below ``AUTO_MIN_TOKENS`` (16K) the cut's fixed cost is not paid back: at 4 heads on an H100, where 64K
    tokens are cut into 16 pieces, 8K tokens (4 pieces of the summary kernels' 8-chunk minimum) stay whole, in one
    segment or as the longest of a packed batch."""
    for bounds in ((0, tokens), (0, 100, 100 + tokens)):
        length = split_module.auto_chunks_per_piece(Span(0, bounds[-1], bounds), 4, 128, 128, 64, sms=132)
        assert (length is not None) == cut, (bounds, length)


@pytest.mark.parametrize("bad", [0, -2, 2.5, "on", True])
def test_split_refused_by_name(bad):
    with pytest.raises(ValueError, match="split must be"):
        check_split(bad)
    args = make_kda_inputs(1, 64, 1, 1, 16, 16, requires_grad=False, seed=0)
    with pytest.raises(ValueError, match="split must be"):
        chunk_kda(**args, backend="torch", split=bad)


def test_chain_states_matches_piece_by_piece():
    """The chain (float64 here; the Triton kernel under the interpreter in tests/kernels) against explicit maps."""
    gen = torch.Generator().manual_seed(3)
    counts = (3, 1, 2)
    S = torch.randn(6, 2, 4, 5, generator=gen, dtype=torch.float64)
    M = torch.randn(6, 2, 4, 4, generator=gen, dtype=torch.float64) * 0.5
    x0 = torch.randn(3, 2, 4, 5, generator=gen, dtype=torch.float64)
    entries, out = chain_states(AffineMap(S, M), counts, x0)
    assert torch.equal(entries[0], x0[0]) and torch.equal(entries[3], x0[1]) and torch.equal(entries[4], x0[2])
    torch.testing.assert_close(entries[1], M[0] @ x0[0] + S[0])
    torch.testing.assert_close(entries[2], M[1] @ entries[1] + S[1])
    torch.testing.assert_close(out[0], M[2] @ entries[2] + S[2])
    back, dS_in = chain_states(AffineMap(S, M), counts, x0, reverse=True)
    assert torch.equal(back[2], x0[0])
    torch.testing.assert_close(back[1], M[2].transpose(-1, -2) @ x0[0] + S[2])
    torch.testing.assert_close(dS_in[0], M[0].transpose(-1, -2) @ back[0] + S[0])
    torch.testing.assert_close(dS_in[1], M[3].transpose(-1, -2) @ x0[1] + S[3])


def _cp_cases(P: int) -> list[dict]:
    head = 5 + 150 * P + 37  # a short document, then one long one
    total = -(-head // (2 * P)) * 2 * P + 60 * P  # a multiple of 2 P: zigzag's chunks
    packed = [0, 5, head, total]
    return [
        # contiguous: the long document runs through the middle ranks at P = 3, its end on a rank with no tail
        dict(name="contiguous-packed", op="kda", B=1, cu=packed, layout="contiguous", init=True, final=True),
        dict(name="zigzag-packed", op="kda", B=1, cu=packed, layout="zigzag", init=True, final=True),
        dict(name="gdn-zigzag-rows", op="gdn", B=2, cu=None, T=2 * P * 100, layout="zigzag", init=True, final=True),
    ]


def _cp_run(rank: int, world_size: int) -> None:
    walks = []

    def spy(maps, counts, initial, reverse=False):
        walks.append(reverse)
        return chain_states(maps, counts, initial, reverse)

    import kdacp.affine as affine_module  # a through rank's forward carries its states by affine.entry_states

    split_module.chain_states = affine_module.chain_states = spy
    for i, case in enumerate(_cp_cases(world_size)):
        check_layout_case(rank, world_size, case, seed=500 * world_size + i, strategies=("p2p",), split=3)
    assert walks.count(False) >= 2 and walks.count(True) >= 2, f"rank {rank}: the split ran {walks}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_split_under_cp_matches_reference(world_size):
    run_ranks(_cp_run, world_size, timeout_s=600)


def test_auto_is_the_default_of_the_ops_and_layers():
    """The ops and the layers cut by ``split="auto"`` unless told otherwise (the context-parallel wrapper's None
    defers to each layer's own)."""
    import inspect

    from kdacp.cp.context import ContextParallel
    from kdacp.layers import GatedDeltaNet, KimiDeltaAttention
    defaults = {f.__qualname__: inspect.signature(f).parameters["split"].default
                for f in (chunk_kda, chunk_gated_delta_rule, KimiDeltaAttention, GatedDeltaNet)}
    assert defaults == dict.fromkeys(defaults, "auto")
    assert inspect.signature(ContextParallel).parameters["split"].default is None
