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


def test_the_load_compiles_where_dynamo_takes_only_python_constants(monkeypatch):
    """torch 2.11's Dynamo converts the arguments of an ``assume_constant_result`` function with
    ``as_python_constant`` only (later releases also pass user objects by identity): the load must be called with
    constants, or a compiled layer fails before its first call (seen on an H100 with torch 2.11)."""
    functions = pytest.importorskip("torch._dynamo.variables.functions")
    if not hasattr(functions, "invoke_and_store_as_constant"):
        pytest.skip("this torch's Dynamo stores assume_constant_result values elsewhere")
    stored = functions.invoke_and_store_as_constant

    def constants_only(tx, fn, name, args, kwargs):
        for arg in [*args, *kwargs.values()]:
            arg.as_python_constant()  # raises on a user object, as torch 2.11 does
        return stored(tx, fn, name, args, kwargs)

    monkeypatch.setattr(functions, "invoke_and_store_as_constant", constants_only)
    torch._dynamo.reset()
    loads = []
    stages = _stages(True, loads)
    compiled = torch.compile(lambda x: stages.load().add(x, 1), fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    assert loads == [1]
