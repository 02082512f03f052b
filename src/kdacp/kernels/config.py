"""The public tiling options of the summary kernels (their precision: :class:`.precision.SummaryPrecision`)."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SummaryConfig:
    """Tiling of the summary kernels; ``None`` fields take each kernel's default.

    Args:
        block_v: state columns per program (16, 32 or 64).
        chunks_per_program: chunks one program walks serially; a longer sequence is cut into
            sub-segments summarised in parallel and folded afterwards (each but one then also walks
            the ``K`` transition columns). ``None``: pick from the grid and the GPU size.
        num_warps, num_stages: Triton launch options of the main kernel (fewer stages are used where
            the requested ones do not fit in shared memory).
        v_first: hold the state tile transposed (``[BV, K]``), so that it is the left (register)
            operand of every product.
        max_registers: registers per thread the compiler may use (Triton's ``maxnreg``, 24 to 255):
            fewer let more programs share an SM, at the cost of spills. ``None``: the compiler's choice.
    """

    block_v: int | None = None
    chunks_per_program: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    v_first: bool | None = None
    max_registers: int | None = None

    def __post_init__(self):
        allowed = {"block_v": (16, 32, 64), "num_warps": (1, 2, 4, 8, 16), "v_first": (False, True)}
        for name, values in allowed.items():
            value = getattr(self, name)
            if value is not None and (type(value) is not type(values[0]) or value not in values):
                raise ValueError(f"SummaryConfig.{name} must be one of {values} or None, got {value!r}")
        for name in ("chunks_per_program", "num_stages"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"SummaryConfig.{name} must be a positive int or None, got {value!r}")
        value = self.max_registers
        if value is not None and (type(value) is not int or not 24 <= value <= 255):
            raise ValueError(f"SummaryConfig.max_registers must be an int from 24 to 255 or None, got {value!r}")

    def resolved(self, default: "SummaryConfig") -> "SummaryConfig":
        """This config with its ``None`` fields taken from ``default``."""
        return replace(default, **{k: v for k, v in self.__dict__.items() if v is not None})


def piece_config(chunks_per_piece: int | None) -> SummaryConfig | None:
    """The summary kernels' config that cuts every sequence into pieces of ``chunks_per_piece`` chunks (the
    pieces a caller's state pass then runs over), or ``None`` (the kernels' own choice) for ``None``."""
    return None if chunks_per_piece is None else SummaryConfig(chunks_per_program=chunks_per_piece)
