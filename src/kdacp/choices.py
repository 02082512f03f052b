"""The names kdacp's string options take, the package's version and the command line's other fixed values,
without torch.

Each is the library's own definition (the modules that use it import it from here), kept free of torch so
that the command line's parser (:mod:`kdacp.options`) builds, and ``kdacp --help`` answers, without
importing it (seconds).
"""
from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the package's version (``kdacp.__version__``, ``kdacp --version``)
VERSION = "0.1.0"
# kdacp's own local backends and "auto", as the command line offers them (:mod:`kdacp.backends.registry` holds
# their specs; a layer or op takes any registered name)
BACKENDS = ("auto", "torch", "fla", "attn_gym")
# the context-parallel modes of :class:`kdacp.ContextParallel`
MODES = ("state", "ulysses", "hybrid")
# kdacp's own state exchanges (:mod:`kdacp.cp.exchanges` registers them; a plan takes any registered
# name: :func:`kdacp.cp.plan.strategy_choices`), and the choices with the cost model's pick
STRATEGIES = ("p2p", "allgather", "scan")
STRATEGY_CHOICES = STRATEGIES + ("auto",)
# the token layouts of :mod:`kdacp.cp.layout`
LAYOUTS = ("contiguous", "zigzag", "document_zigzag", "balanced_documents")
# the benchmark batches of :mod:`kdacp.bench.batches`
BATCHES = ("one_sequence", "docs7", "lognormal")
# the benchmark suites of :mod:`kdacp.bench`, and those that also run without a GPU
SUITES = ("kernels", "cp", "gdn", "layer", "virtual", "soak", "scaling", "overhead", "hybrid", "balance")
CPU_SUITES = ("layer", "virtual", "soak", "scaling", "overhead", "hybrid", "balance")
# the virtual suite's reference chunk size: a rank's tokens are a multiple of it
VIRTUAL_CHUNK = 64
# the dtypes of ``kdacp demo``'s context-parallel model
DEMO_DTYPES = ("float32", "bfloat16")
# where ``kdacp tune`` writes a user's own configurations (preferred over the shipped ones)
USER_CONFIGS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kdacp" / "fla-configs"


class SummaryPrecision(str, enum.Enum):
    """How the summary kernels round the float32 operand of each state product, with bf16 inputs.

    ``exact``: three bf16 pieces (~24 bits, float32-faithful); ``two_piece``: two (~16 bits);
    ``mixed``: the transition ``M`` (and the sub-segment ``M^T`` of the gradient kernel) in one piece,
    ``S_ext`` and ``G`` in two; ``one_piece``: one (8 bits: the state rounded to bf16 before each
    product, float32 accumulation, as FLA's own state pass); ``one_piece_forward``: one piece in the forward
    summary (``S_ext``, ``M``), two in the gradient summary ``G`` (whose one-piece walk is no faster). fp16
    and float32 inputs run float32 products (3xTF32) whatever the policy. Relative errors and times:
    benchmarks/RESULTS.md.
    """

    EXACT = "exact"
    TWO_PIECE = "two_piece"
    MIXED = "mixed"
    ONE_PIECE = "one_piece"
    ONE_PIECE_FORWARD = "one_piece_forward"

    def pieces(self, dtype: torch.dtype, backward: bool = False) -> tuple[int, int]:
        """``(PIECES, M_PIECES)`` of the forward summary kernel (``backward``: of the gradient summary kernel)
        for inputs of ``dtype``: bf16 pieces of the float32 operand in the ``S_ext``/``G`` columns and in the
        transition columns; 0 means float32 products."""
        import torch  # here, so that the command line's parser builds without torch
        if dtype != torch.bfloat16:
            return 0, 0
        if self is SummaryPrecision.ONE_PIECE_FORWARD:
            return (2, 2) if backward else (1, 1)
        return {"exact": (3, 3), "two_piece": (2, 2), "mixed": (2, 1), "one_piece": (1, 1)}[self.value]
