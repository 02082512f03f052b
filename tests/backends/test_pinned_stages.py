"""kdacp.backends.pinned_stages.PinnedStages under torch.compile: the dependency's load runs as plain Python at
trace time (its imports and checks never traced), in one graph, and answers as it does eagerly."""
import functools
from types import SimpleNamespace

import pytest
import torch

from kdacp.backends.pinned_stages import PinnedStages


def _stages(usable: bool, loads: list) -> PinnedStages:
    @functools.cache
    def load():
        loads.append(1)
        with open(__file__) as f:  # file I/O, which torch.compile cannot put in a graph (as an import's)
            f.read(1)
        return (SimpleNamespace(add=torch.add), None) if usable else (None, "dep is not installed; pip install dep")
    return PinnedStages(load)


def test_a_compiled_call_loads_the_stages_outside_its_graph():
    loads = []
    stages = _stages(True, loads)

    def step(x):
        stages.require()
        return stages.load().add(x, 1) if stages.available() else x

    out = torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))
    assert loads == [1]  # run once, as plain Python (traced, its file I/O would have failed the one graph)


def test_unusable_stages_refuse_by_name_eagerly_and_compiled():
    stages = _stages(False, [])
    assert not stages.available()
    with pytest.raises(ImportError, match="dep is not installed"):
        stages.load()
    compiled = torch.compile(lambda x: x + 1 if stages.available() else x - 1, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.ones(2)), torch.zeros(2))
