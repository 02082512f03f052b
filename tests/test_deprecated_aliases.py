"""The old import paths of context parallelism (``kdacp.distributed``, ``kdacp.layers.context_parallel``,
``ContextParallel`` and the per-batch context from ``kdacp.layers``) and of the ops (``kdacp.kda``,
``kdacp.gdn``) and of the Hugging Face integration (``kdacp.models``) still work for one release: each warns with
the new path and gives the very objects of :mod:`kdacp.cp`, :mod:`kdacp.ops` and
:mod:`kdacp.integrations.transformers`."""
import importlib
import sys

import pytest

import kdacp.bench.rank_role
import kdacp.cp
import kdacp.ops
import kdacp.ops.gdn
import kdacp.ops.kda


def _import_fresh(name: str):
    """``name`` imported anew (its module-level warning raised again)."""
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_distributed_warns_and_gives_the_cp_objects():
    with pytest.warns(DeprecationWarning, match="kdacp.cp"):
        old = _import_fresh("kdacp.distributed")
    for name in ("CPPlan", "STRATEGIES", "build_cp_plan", "init_device_mesh", "new_cp_group"):
        with pytest.warns(DeprecationWarning, match=f"kdacp.cp.{name}"):
            assert getattr(old, name) is getattr(kdacp.cp, name)
    for name in ("RankRole", "StandInExchange"):
        with pytest.warns(DeprecationWarning, match=f"kdacp.bench.rank_role.{name}"):
            assert getattr(old, name) is getattr(kdacp.bench.rank_role, name)
    with pytest.raises(AttributeError):
        old.no_such_name


def test_distributed_from_import_warns():
    sys.modules.pop("kdacp.distributed", None)
    with pytest.warns(DeprecationWarning, match="kdacp.cp"):
        from kdacp.distributed import build_cp_plan, new_cp_group
    assert (build_cp_plan, new_cp_group) == (kdacp.cp.build_cp_plan, kdacp.cp.new_cp_group)


def test_layers_context_parallel_warns_and_gives_the_cp_objects():
    from kdacp.cp import batch_context, context
    with pytest.warns(DeprecationWarning, match="kdacp.cp"):
        old = _import_fresh("kdacp.layers.context_parallel")
    assert old.ContextParallel is kdacp.cp.ContextParallel is context.ContextParallel
    assert old.SINGLE_DEVICE is context.SINGLE_DEVICE
    assert (old.CPContext, old.build_cp_context) == (batch_context.CPContext, batch_context.build_cp_context)


def test_layers_package_warns_for_the_names_that_moved():
    import kdacp.layers
    for name in ("ContextParallel", "CPContext", "build_cp_context"):
        with pytest.warns(DeprecationWarning, match=f"kdacp.cp.{name}"):
            assert getattr(kdacp.layers, name) is getattr(kdacp.cp, name)
    with pytest.warns(DeprecationWarning, match="kdacp.cp.ContextParallel"):
        from kdacp.layers import ContextParallel
    assert ContextParallel is kdacp.cp.ContextParallel


def test_the_top_level_names_come_from_cp_without_a_warning(recwarn):
    import kdacp
    assert kdacp.ContextParallel is kdacp.cp.ContextParallel and kdacp.build_cp_plan is kdacp.cp.build_cp_plan
    assert kdacp.CPContext is kdacp.cp.CPContext and kdacp.new_cp_group is kdacp.cp.new_cp_group
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "kdacp" in str(w.message)]


def test_kda_warns_and_gives_the_ops_objects():
    with pytest.warns(DeprecationWarning, match="kdacp.ops.kda"):
        old = _import_fresh("kdacp.kda")
    for name in ("ChunkKDAFunction", "check_and_prepare", "chunk_kda", "run_prepared"):
        assert getattr(old, name) is getattr(kdacp.ops.kda, name)
    assert old.chunk_kda is kdacp.ops.chunk_kda


def test_gdn_warns_and_gives_the_ops_objects():
    with pytest.warns(DeprecationWarning, match="kdacp.ops.gdn"):
        old = _import_fresh("kdacp.gdn")
    for name in ("chunk_gated_delta_rule", "gdn_gate_arguments"):
        assert getattr(old, name) is getattr(kdacp.ops.gdn, name)
    assert old.chunk_gated_delta_rule is kdacp.ops.chunk_gated_delta_rule


def test_ops_from_import_warns():
    sys.modules.pop("kdacp.kda", None)
    sys.modules.pop("kdacp.gdn", None)
    with pytest.warns(DeprecationWarning, match="kdacp.ops.kda"):
        from kdacp.kda import chunk_kda
    with pytest.warns(DeprecationWarning, match="kdacp.ops.gdn"):
        from kdacp.gdn import chunk_gated_delta_rule
    assert (chunk_kda, chunk_gated_delta_rule) == (kdacp.ops.chunk_kda, kdacp.ops.chunk_gated_delta_rule)


def test_the_top_level_ops_come_from_ops_without_a_warning(recwarn):
    import kdacp
    assert kdacp.chunk_kda is kdacp.ops.chunk_kda is kdacp.ops.kda.chunk_kda
    assert kdacp.chunk_gated_delta_rule is kdacp.ops.chunk_gated_delta_rule is kdacp.ops.gdn.chunk_gated_delta_rule
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "kdacp" in str(w.message)]


def test_models_warns_and_gives_the_new_objects():
    import kdacp.cp.sharding
    import kdacp.integrations.transformers
    with pytest.warns(DeprecationWarning, match="kdacp.integrations.transformers"):
        old = _import_fresh("kdacp.models")
    for name in ("shard_batch", "shard_tokens", "ShardedBatch", "global_token_mean_loss"):
        with pytest.warns(DeprecationWarning, match=f"kdacp.cp.sharding.{name}"):
            assert getattr(old, name) is getattr(kdacp.cp.sharding, name)
    for name in ("parallelize", "prefill", "generate", "own_forwards", "load_kimi_linear", "torch_fallbacks"):
        with pytest.warns(DeprecationWarning, match=f"kdacp.integrations.transformers.{name}"):
            assert getattr(old, name) is getattr(kdacp.integrations.transformers, name)
    with pytest.raises(AttributeError):
        old.no_such_name
