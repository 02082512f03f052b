"""The split inside one device: long sequences cut into pieces whose state passes run at once.

FLA's chunked state passes walk the chunks of a sequence one after another on ``HV x V / BV`` programs; with
few heads and long sequences most SMs idle. The algebra of the exchange between ranks serves inside one device:
cut each long segment of a span into pieces of ``L`` chunks (from its first token, so that every piece but the
last is whole chunks), summarise every piece in parallel (``S_ext``, ``M``: one summary launch), carry the
states along each segment's pieces (:func:`kdacp.affine.chain_states`: one launch), and run one state pass over
all pieces at once, each from the state entering it. Backward mirrors it: the local backward over the pieces
from those entering states, the gradient summaries ``G`` of every piece, the gradients carried back along the
pieces with ``M^T``, and one gradient pass over all pieces. Outputs, final states and gradients are those of
the uncut span, to rounding (the summaries' precision policy, as for context parallelism).

The cut is chosen per span by :func:`chunks_per_piece`: ``split="auto"`` (on a GPU, when the longest segment holds
at least :data:`AUTO_MIN_TOKENS` and the pieces the summary kernels pick to fill it cut it into at least
:data:`AUTO_MIN_PIECES`), an int (pieces of the longest segment), or ``None`` (no cut).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from ..affine import AffineMap, chain_states
from ..backends.base import LocalBackend, LocalStates, Span
from ..host_copies import take_rows
from ..kernels.subsegments import pick_chunks_per_program, sm_count

# ``split="auto"`` cuts only where the longest segment's serial walk gets at least this many times shorter: the
# summaries and the chain cost about one more walk of a piece, and a state pass that already fills the GPU (many
# heads, or many sequences) gains nothing from more programs.
AUTO_MIN_PIECES = 4
# ... and into at most this many: the chain carries the states along a segment's pieces one after another (about
# 14 us a piece at 4 heads of 128 on an H100, twice in a forward + backward), so past 16 pieces it costs more than
# the wider pass saves. On one H100 at 64K tokens and 2 heads, 32 pieces took 1.07x (KDA forward) and 1.04x
# (forward + backward) the time of 16, and 1.21x / 1.05x in an earlier run (benchmarks/RESULTS.md, Split inside one
# GPU); at 4 to 16 heads the summary kernels' own choice (2 programs per SM) was within 5% of the best count.
AUTO_MAX_PIECES = 16
# ... and only a segment of at least this many tokens: the cut's fixed cost (three more launches and their host time,
# about 0.1 ms, where a short call is host-bound) is paid back at about 13 us per 1K tokens at 4 heads of 128 on an
# H100 (forward: FLA's state pass walks 64K tokens in 1.47 ms, the cut's pass at 8 pieces in 0.27 ms, its summaries
# and chain add 0.37 ms; benchmarks/RESULTS.md, Split inside one GPU), about 8K tokens to break even; twice that.
AUTO_MIN_TOKENS = 16384
# state columns per program of the summary kernels (their default ``block_v``)
_SUMMARY_BLOCK_V = 64


def check_split(split) -> None:
    """Raise ``ValueError`` unless ``split`` is ``"auto"``, ``None`` or a positive int."""
    if split is None or split == "auto" or (type(split) is int and split >= 1):
        return
    raise ValueError(f"split must be 'auto', a positive int (pieces of the longest sequence; 1: no split) or "
                     f"None (no split), got {split!r}")


def chunks_per_piece(split, backend: LocalBackend, span: Span, HV: int, K: int, V: int,
                     device: torch.device) -> int | None:
    """The length in chunks of the pieces ``span``'s segments are cut into, or ``None`` for no cut.

    ``split`` as :func:`check_split`; an int ``S`` cuts the longest segment into ``S`` pieces (others into as
    many pieces of the same length as they need); ``"auto"``, on a CUDA device whose current stream is not
    capturing a CUDA graph, :func:`auto_chunks_per_piece`. Inside a capture ``"auto"`` never cuts: a cut call's
    forward + backward captured in a CUDA graph failed on an H100 (benchmarks/RESULTS.md, GPU tests), and a
    capture (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``) must not be invalidated by a
    default. Backends that cannot summarise pieces (``summary_pieces`` false) never cut; the chunk length is the
    backend's (``options.chunk_size``)."""
    if split is None or split == 1 or span.empty or not backend.summary_pieces:
        return None
    chunk_size = backend.options.chunk_size
    if split == "auto":
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return None
        return auto_chunks_per_piece(span, HV, K, V, chunk_size, sm_count(device))
    longest = triton.cdiv(_longest_tokens(span), chunk_size)
    length = triton.cdiv(longest, split)
    return length if length < longest else None


def _longest_tokens(span: Span) -> int:
    """The tokens of ``span``'s longest segment."""
    return max(e - s for s, e in zip(span.cu_seqlens[:-1], span.cu_seqlens[1:]))


def auto_chunks_per_piece(span: Span, HV: int, K: int, V: int, chunk_size: int, sms: int) -> int | None:
    """``split="auto"``'s pieces of ``span``'s segments on a GPU of ``sms`` SMs, in chunks of ``chunk_size``
    tokens, or ``None`` for no cut: the summary kernels' own choice, about two programs per SM of
    ``HV x (V + K) / 64`` programs a piece (:func:`pick_chunks_per_program`), where that cuts the longest segment
    into at least :data:`AUTO_MIN_PIECES`, and into no more than :data:`AUTO_MAX_PIECES`; no cut where the longest
    segment is shorter than :data:`AUTO_MIN_TOKENS`."""
    longest_tokens = _longest_tokens(span)
    if longest_tokens < AUTO_MIN_TOKENS:
        return None
    longest = triton.cdiv(longest_tokens, chunk_size)
    bounds = [(0, s, e) for s, e in zip(span.cu_seqlens[:-1], span.cu_seqlens[1:])]
    block_v = min(_SUMMARY_BLOCK_V, K, V)
    length = pick_chunks_per_program(bounds, HV * (V + K) // block_v, chunk_size, None, sms=sms)
    if triton.cdiv(longest, length) < AUTO_MIN_PIECES:
        return None
    return max(length, triton.cdiv(longest, AUTO_MAX_PIECES))


@dataclass(frozen=True)
class SplitPieces:
    """A span's cut, as its forward ran it: ``starts`` (each piece's first token, from the span's first; host
    ints), ``counts`` (pieces per segment), ``entries [n, HV, K, V]`` (the state entering each piece) and
    ``transitions [n, HV, K, K]`` (each piece's ``M``), float32 (float64 for float64 inputs)."""

    starts: tuple[int, ...]
    counts: tuple[int, ...]
    entries: torch.Tensor
    transitions: torch.Tensor

    def first_pieces(self) -> list[int]:
        """The index of each segment's first piece."""
        return [sum(self.counts[:i]) for i in range(len(self.counts))]

    def last_pieces(self) -> list[int]:
        """The index of each segment's last piece."""
        return [sum(self.counts[:i + 1]) - 1 for i in range(len(self.counts))]


def split_state_pass(backend: LocalBackend, chunks, span: Span, initial_state: torch.Tensor | None,
                     output_final_state: bool, length: int) -> tuple[LocalStates, SplitPieces]:
    """The state pass of ``span`` from ``initial_state [n_segments, HV, K, V]`` (or ``None``: zeros), run over
    its segments cut into pieces of ``length`` chunks: ``(states, pieces)``, ``states`` as the uncut pass's (``h``
    and ``v_new`` of every chunk, each segment's final state) and ``pieces`` what the backward needs."""
    parts = backend.state_summary(chunks, span, with_transition=True, parts=True, chunks_per_piece=length)
    entries, _ = chain_states(parts.parts, parts.counts, initial_state)
    states = backend.state_pass(chunks, span.cut(parts.starts), entries, output_final_state)
    pieces = SplitPieces(parts.starts, parts.counts, entries, parts.parts.transition)
    final = None if states.final_state is None else take_rows(states.final_state, pieces.last_pieces())
    return replace(states, final_state=final), pieces


class RankBackward:
    """One rank's local backward over a span, cut as its forward's state pass was (``pieces``) or whole
    (``None``): :meth:`gradient_summary` and :meth:`gradient_pass` answer per segment of the uncut span either way.

    Cut, the local backward runs over the pieces from the states that entered them, and every piece's gradient
    summary ``G`` is formed once, up front (:meth:`gradient_summary` carries them back along each segment with
    ``M^T``; :meth:`gradient_pass` carries the segments' final-state gradients to every piece first).
    """

    def __init__(self, backend: LocalBackend, saved, span: Span, do: torch.Tensor, initial_state: torch.Tensor | None,
                 states: LocalStates | None, pieces: SplitPieces | None):
        """``initial_state [n_segments, HV, K, V]`` (or ``None``), ``states``: the forward's state pass of exactly
        this span, if kept (else recomputed), as :meth:`~kdacp.backends.base.LocalBackend.backward_local`."""
        self.backend, self.pieces = backend, pieces
        if pieces is None:
            self.local = backend.backward_local(saved, span, do, initial_state, states)
            self._piece_summaries = None
        else:
            self.local = backend.backward_local(saved, span.cut(pieces.starts), do, pieces.entries, states)
            self._piece_summaries = backend.state_gradient_summary(self.local)

    def _chain(self, dht: torch.Tensor | None):
        return chain_states(AffineMap(self._piece_summaries, self.pieces.transitions), self.pieces.counts, dht,
                            reverse=True)

    def gradient_summary(self, segments: tuple[int, int] | None = None) -> torch.Tensor:
        """``G [n, HV, K, V]``: the gradient reaching each segment's initial state when its final state's is zero;
        of segments ``first`` to ``last - 1`` only with ``segments = (first, last)``."""
        if self.pieces is None:
            return self.backend.state_gradient_summary(self.local, segments=segments)
        G = self._chain(None)[1]
        return G if segments is None else G[segments[0]:segments[1]]

    def gradient_pass(self, dht: torch.Tensor | None, segments: int | None = None):
        """The gradient state pass (:meth:`~kdacp.backends.base.LocalBackend.backward_states`) from each segment's
        final-state gradient ``dht [n, HV, K, V]`` (``None``: zero); its ``dinitial_state`` is per segment.
        ``segments``: the pass over the first ``segments`` segments only (uncut spans only)."""
        if self.pieces is None:
            return self.backend.backward_states(self.local, dht, segments=segments)
        if segments is not None:
            raise ValueError("a cut span's gradient pass runs over all of its segments")
        dht_pieces, _ = self._chain(dht)
        states = self.backend.backward_states(self.local, dht_pieces)
        return replace(states, dinitial_state=take_rows(states.dinitial_state, self.pieces.first_pieces()))
