"""A local backend whose stages sleep: ranks of the scaling model's composition check that need no core."""
from __future__ import annotations

import time

import torch

from kdacp.affine import AffineMap, SummaryParts
from kdacp.backends.base import BackwardStates, KDAInputs, LocalGrads, LocalStates

# Seconds each stage of SleepBackend sleeps for a whole rank's tokens, ten times an H200's at 16K
# tokens: the summaries and state passes from issue 3's figures, the other stages a rough split of
# the rest of the 10.45 ms one-GPU step (issue 4).
SLEEP_STAGES = dict(prepare=0.015, state_summary=0.004, state_pass=0.004, output=0.008, backward_local=0.020,
                    state_gradient_summary=0.004, backward_states=0.004, backward_inputs=0.035)
# Stages whose chain dominates: the state passes (what a receiving rank waits for, then runs) are most
# of a layer, so composing a step layer by layer and as a wavefront (:func:`~kdacp.bench.scaling_model.
# predict_step`) differ by far more than a measurement's spread.
CHAIN_STAGES = dict(prepare=0.002, state_summary=0.004, state_pass=0.010, output=0.002, backward_local=0.002,
                    state_gradient_summary=0.004, backward_states=0.010, backward_inputs=0.002)


class SleepBackend:
    """A :class:`~kdacp.backends.base.LocalBackend` whose stages sleep (``stages``, default
    :data:`SLEEP_STAGES`: seconds for the whole rank's ``tokens``, times the span's share of them) and
    return zeros of the right shapes (the same tensors each call: read them, never write into them). Ranks that sleep use no core, so on a CPU shared by more ranks
    than cores (and by other jobs) they behave as if each had its own device: the orchestration, the
    exchanges and the link are real, the compute is not."""

    name = "sleep"
    parallel_pieces = False  # its stages sleep the times of the FLA backend's
    summary_pieces = False  # no split inside the device: its stages are timed whole
    dtype = torch.float32

    def __init__(self, tokens: int, stages: dict | None = None):
        self.tokens, self._made = tokens, {}
        self.stages = SLEEP_STAGES if stages is None else stages
        if set(self.stages) != set(SLEEP_STAGES):
            raise ValueError(f"stages must give seconds for exactly {sorted(SLEEP_STAGES)}, got {sorted(self.stages)}")

    def _sleep(self, stage: str, span) -> None:
        seconds = self.stages[stage] * (span.end - span.start) / self.tokens
        if seconds > 0:  # a zero sleep still yields the CPU (tens of us): none at all where a stage takes no time
            time.sleep(seconds)

    def _zeros(self, n: int, *shape):
        """Zeros ``[n, *shape]``: one tensor per shape, made once and handed out again (a caller must not write
        into it), so that a host-time measurement times the caller's work, not this stand-in's allocations."""
        key = (n, *shape)
        if key not in self._made:
            self._made[key] = torch.zeros(key, dtype=self.dtype)
        return self._made[key]

    def prepare(self, inputs: KDAInputs, span):
        self._sleep("prepare", span)
        self.H, self.K = inputs.q.shape[2:]
        self.HV, self.V = inputs.v.shape[2:]
        return None

    def state_summary(self, chunks, span, with_transition: bool, parts: bool = False,
                      chunks_per_piece: int | None = None):
        """Zero summaries; ``parts``: one piece per segment (its state pass then runs as one, as timed);
        ``chunks_per_piece`` must be ``None`` (``summary_pieces`` is false)."""
        if chunks_per_piece is not None:
            raise ValueError("the sleep backend summarises whole segments only (summary_pieces is False)")
        self._sleep("state_summary", span)
        n = span.num_segments
        summary = AffineMap(self._zeros(n, self.HV, self.K, self.V),
                            self._zeros(n, self.HV, self.K, self.K) if with_transition else None)
        return SummaryParts(summary, summary, span.cu_seqlens[:-1], (1,) * n) if parts else summary

    def state_pass(self, chunks, span, initial_state, output_final_state: bool) -> LocalStates:
        self._sleep("state_pass", span)
        return LocalStates(self._zeros(span.num_segments, self.HV, self.K, self.V) if output_final_state else None)

    def output(self, chunks, span, initial_state, states) -> torch.Tensor:
        self._sleep("output", span)
        return self._zeros(1, span.end - span.start, self.HV, self.V)

    def to_saved(self, chunks):
        return None

    def backward_local(self, saved, span, do, initial_state, states=None):
        self._sleep("backward_local", span)
        return span

    def state_gradient_summary(self, local, segments=None) -> torch.Tensor:
        local = local if segments is None else local.segments(*segments)
        self._sleep("state_gradient_summary", local)
        return self._zeros(local.num_segments, self.HV, self.K, self.V)

    def backward_states(self, local, dht, segments=None) -> BackwardStates:
        local = local if segments is None else local.prefix(segments)
        self._sleep("backward_states", local)
        return BackwardStates(local, self._zeros(local.num_segments, self.HV, self.K, self.V))

    def backward_inputs(self, states: BackwardStates) -> LocalGrads:
        self._sleep("backward_inputs", states.span)
        T = states.span.end - states.span.start
        return LocalGrads(self._zeros(1, T, self.H, self.K), self._zeros(1, T, self.H, self.K),
                          self._zeros(1, T, self.HV, self.V), self._zeros(1, T, self.HV, self.K),
                          self._zeros(1, T, self.HV), None, None)


def sleep_inputs(T: int) -> KDAInputs:
    """Inputs of ``T`` tokens for :class:`SleepBackend`: one head, K = V = 16 (small messages)."""
    return KDAInputs(*(torch.zeros(1, T, 1, 16) for _ in range(4)), torch.zeros(1, T, 1))
