"""``kdacp.parallelize`` inside the stack people train with: 4 gloo ranks as 2 (dp) x 2 (cp) on a
``DeviceMesh`` (:func:`kdacp.init_device_mesh`), tiny Kimi Linear and Qwen3-Next (2 key/value heads; the
configs of tests/models/test_kimi_linear_cp.py and test_qwen3_next_cp.py), against the unmodified
one-process model trained on the same global batches (both replicas' documents, one at a time).

Each rank's loss is the model's own ``.loss`` on its shard from :func:`kdacp.shard_batch`, over the loss
group (the flattened dp x cp mesh). Three wrappers in turn, 3 AdamW steps each, with no collective written
here: FSDP2's ``fully_shard`` on every decoder layer and the root over the flattened mesh; DDP over the same
ranks; FSDP2 with activation checkpointing (``model.gradient_checkpointing_enable()``). Checked: the first
step's every gradient (``TOL`` relative, 2-norm, as the CP tests), the three losses (``TOL``), every parameter
after the three steps (``PARAM_TOL``). AdamW's first steps move each weight by about ``lr * sign(grad)``
where ``|grad| >> eps``, so float32 rounding of a gradient near zero could move a weight by up to ``2 lr``: with
``eps = 1e-5`` such gradients take steps in proportion (at ``eps = 1e-8``, 1.0e-5 was measured). The same
ranks show that the loss group matters (the loss over the cp group alone leaves ``TOL``). Kimi Linear also
saves a ``torch.distributed.checkpoint`` after step 2; fresh processes load it and take step 3, which must
equal the uninterrupted run's step 3 bitwise.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers  # noqa: F401  (in the `test` extra: a missing install fails here, not skips)

from tests.helpers import rel_err
from tests.models.cp_common import TOL, VOCAB
from tests.multiprocess import run_ranks

DP, CP = 2, 2
STEPS, LR, EPS = 3, 1e-3, 1e-5
PARAM_TOL = 1e-5
# Each replica's packed batch: 64 tokens (32 per cp rank), documents cut across the cp edge at 32; the
# replicas hold different numbers of labelled tokens, so the loss group's token count matters.
DOCUMENTS = ([0, 21, 40, 64], [0, 9, 30, 35, 64])
WRAPPERS = ("fsdp", "ddp", "fsdp+checkpointing")


def _tokens(step: int, replica: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, DOCUMENTS[replica][-1]), generator=torch.Generator().manual_seed(
        100 * step + replica))


def _family(name: str):
    """``(make_model, reference context)`` of a model family."""
    if name == "kimi_linear":
        from kdacp.integrations.transformers import torch_fallbacks
        from tests.models.test_kimi_linear_cp import _model
        return _model, torch_fallbacks
    from tests.models.test_qwen3_next_cp import _model, _transformers_recurrent_gdn
    return _model, _transformers_recurrent_gdn


def _reference(name: str) -> dict:
    """The unmodified model trained one document at a time on both replicas' batches: the first step's
    gradients, each step's global token-mean loss, the parameters after the last step."""
    make_model, context = _family(name)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    out = {"losses": []}
    with context():
        for step in range(STEPS):
            total = sum(len(cu) - 1 for cu in DOCUMENTS)
            count = sum(cu[-1] for cu in DOCUMENTS) - total
            loss = 0.0
            for replica, cu in enumerate(DOCUMENTS):
                ids = _tokens(step, replica)
                for s, e in zip(cu, cu[1:]):
                    logits = model(input_ids=ids[:, s:e], use_cache=False).logits[0]
                    loss = loss + F.cross_entropy(logits[:-1], ids[0, s + 1:e], reduction="sum")
            loss = loss / count
            loss.backward()
            if step == 0:
                out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            out["losses"].append(loss.item())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole tensor (FSDP2 shards parameters and gradients), a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _setup(name: str, wrapper: str, seed: int = 0, layout: str = "contiguous"):
    """A parallelised model on the (dp, cp) mesh under ``wrapper`` and the token ``layout``, its AdamW and the
    meshes."""
    import kdacp
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    mesh = kdacp.init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    make_model, _ = _family(name)
    model = make_model()
    if seed:  # a different start, for the checkpoint to overwrite
        with torch.no_grad():
            for p in model.parameters():
                p.add_(seed * 1e-2)
    kdacp.parallelize(model, mesh["cp"], layout=layout, loss_group=dp_cp)
    if wrapper.endswith("checkpointing"):
        model.gradient_checkpointing_enable()
        assert model.is_gradient_checkpointing
    if wrapper.startswith("fsdp"):
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_cp)
        fully_shard(model, mesh=dp_cp)
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model, process_group=dp_cp.get_group())
    return model, wrapped, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), mesh


def _step(wrapped, optimizer, mesh, step: int, layout: str = "contiguous") -> torch.Tensor:
    """One training step on this rank's shard (under ``layout``) of its replica's batch; returns the loss."""
    import kdacp
    replica = mesh.get_local_rank("dp")
    batch = kdacp.shard_batch(_tokens(step, replica), cu_seqlens=torch.tensor(DOCUMENTS[replica]), group=mesh["cp"],
                              layout=layout)
    loss = wrapped(**batch.model_kwargs()).loss
    loss.backward()
    return loss.detach()


def _train(name: str, wrapper: str, ref: dict, checkpoint_dir: str = "", layout: str = "contiguous"):
    """``STEPS`` AdamW steps under ``wrapper`` and ``layout`` against ``ref``: every loss, the first step's every
    gradient and the final parameters within tolerance (an assertion each). Returns ``(final parameters, (worst
    gradient, worst parameter))``; saves a checkpoint after step 2 into ``checkpoint_dir`` (FSDP2, if given)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, wrapped, optimizer, mesh = _setup(name, wrapper, layout=layout)
    for step in range(STEPS):
        loss = _step(wrapped, optimizer, mesh, step, layout)
        assert rel_err(loss, torch.tensor(ref["losses"][step])) < TOL, f"{wrapper}: loss of step {step}"
        if step == 0:
            missing = [n for n, p in model.named_parameters() if p.grad is None]
            assert not missing, f"{wrapper}: no gradient for {missing}"
            errs = {n: rel_err(_full(p.grad), ref["grads"][n]) for n, p in model.named_parameters()}
            worst_grad = max(errs.items(), key=lambda kv: kv[1])
            assert worst_grad[1] < TOL, f"{wrapper}: gradient of {worst_grad[0]} off by {worst_grad[1]:.2e}"
        optimizer.step()
        optimizer.zero_grad()
        if step == STEPS - 2 and wrapper == "fsdp" and checkpoint_dir:
            msd, osd = get_state_dict(model, optimizer)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=checkpoint_dir)
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
    errs = {n: rel_err(p, ref["params"][n]) for n, p in params.items()}
    worst_param = max(errs.items(), key=lambda kv: kv[1])
    assert worst_param[1] < PARAM_TOL, f"{wrapper}: {worst_param[0]} off by {worst_param[1]:.2e} after {STEPS} steps"
    return params, (worst_grad, worst_param)


def _worker(rank, world_size, name, ref, results, checkpoint_dir):
    import kdacp
    with pytest.raises(ValueError, match="1-D DeviceMesh"):  # a 2-D mesh is not one group
        kdacp.shard_batch(_tokens(0, 0), group=kdacp.init_device_mesh("cpu", (DP, CP), mesh_dim_names=("a", "b")))
    worst = {}
    for wrapper in WRAPPERS:
        params, worst[wrapper] = _train(name, wrapper, ref, checkpoint_dir)
        if wrapper == "fsdp" and rank == 0:
            results["params"] = params
        dist.barrier()

    # The loss group matters: the loss over the cp group alone (each replica's own mean) is another gradient.
    from functools import partial

    from kdacp.cp.sharding import causal_lm_loss
    model, wrapped, optimizer, mesh = _setup(name, "fsdp")
    model.loss_function = partial(causal_lm_loss, group=mesh["cp"].get_group())
    _step(wrapped, optimizer, mesh, 0)
    wrong = max(rel_err(_full(p.grad), ref["grads"][n]) for n, p in model.named_parameters())
    assert wrong > 100 * TOL, "the loss group went unnoticed"
    worst["loss over the cp group only"] = wrong
    if rank == 0:
        results["worst"] = worst


def _resume_worker(rank, world_size, name, results, checkpoint_dir):
    """Fresh processes: load the checkpoint saved after step 2 into a differently started model and take step 3."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, wrapped, optimizer, mesh = _setup(name, "fsdp", seed=1)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _step(wrapped, optimizer, mesh, STEPS - 1)
    optimizer.step()
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
    if rank == 0:
        results["params"] = params


@pytest.mark.parametrize("name", ["kimi_linear", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_fsdp_ddp_checkpointing_on_dp_cp_mesh(name):
    ref = _reference(name)
    manager = torch.multiprocessing.Manager()
    results = manager.dict()
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        save = checkpoint_dir if name == "kimi_linear" else ""
        run_ranks(_worker, DP * CP, name, ref, results, save)
        print({k: v for k, v in results["worst"].items()})
        if save:
            resumed = manager.dict()
            run_ranks(_resume_worker, DP * CP, name, resumed, save)
            differ = [n for n, p in results["params"].items() if not torch.equal(p, resumed["params"][n])]
            assert not differ, f"step 3 after loading the step-2 checkpoint differs in {differ}"


def _zigzag_worker(rank, world_size, name, ref, results):
    _, worst = _train(name, "fsdp", ref, layout="zigzag")
    if rank == 0:
        results["worst"] = worst


@pytest.mark.parametrize("name", ["kimi_linear", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_fsdp_under_zigzag_on_dp_cp_mesh(name):
    """FSDP2 over the flattened 2 x 2 mesh with each replica's batch sharded under zigzag over its cp ranks: the
    same losses, first-step gradients and parameters after three steps as one process."""
    results = torch.multiprocessing.Manager().dict()
    run_ranks(_zigzag_worker, DP * CP, name, _reference(name), results)
    print(dict(results))
