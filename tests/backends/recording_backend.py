"""A test-only backend added as one module and one registry line: the ``torch`` backend's stages, each call
counted in :data:`CALLS` (per process, so per rank)."""
from __future__ import annotations

from collections import Counter

from kdacp.backends import BackendSpec, register_backend
from kdacp.backends.torch_backend import TorchBackend

CALLS: Counter = Counter()
STAGES = ("prepare", "state_summary", "state_pass", "output", "to_saved", "backward_local", "state_gradient_summary",
          "backward_states", "backward_inputs")


def _counted(stage: str):
    def stage_call(self, *args, **kwargs):
        CALLS[stage] += 1
        return getattr(TorchBackend, stage)(self, *args, **kwargs)
    stage_call.__name__ = stage
    return stage_call


class RecordingBackend(TorchBackend):
    name = "recording"


for _stage in STAGES:
    setattr(RecordingBackend, _stage, _counted(_stage))


register_backend(BackendSpec("recording", lambda options, scalar_gate: RecordingBackend(options)))
