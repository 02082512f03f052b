"""Train a tiny transformers Kimi Linear with kdacp's context parallelism and FSDP2 on one DeviceMesh.

    torchrun --nproc-per-node 4 examples/train_fsdp.py            # CPU (gloo): 2 (dp) x 2 (cp)
    torchrun --nproc-per-node 8 examples/train_fsdp.py --cp 4     # GPUs (NCCL): 2 (dp) x 4 (cp)

The mesh has a data-parallel and a context-parallel dim. ``kdacp.parallelize`` takes the cp dim; FSDP2
shards and averages gradients over both flattened (``dp_cp``, as torchtitan does); each rank's
``model(**batch.model_kwargs()).loss`` is scaled for that average (the loss-scaling contract of
``kdacp.models.batch``), so ``backward()`` leaves every gradient that of the mean loss over all tokens of
the global batch, with no collective written here.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import kdacp


def tiny_kimi_linear(vocab_size: int):
    """A random 3-layer Kimi Linear (KDA, MLA, KDA), loaded through kdacp before any process group exists."""
    kl = kdacp.models.load_kimi_linear()
    config = kl.KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_implementation="sdpa")
    return kl.KimiLinearForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2, help="context-parallel ranks (the rest is data-parallel)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="tokens of each data-parallel replica's batch")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial model on every rank
    model = tiny_kimi_linear(vocab_size=128)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    world = dist.get_world_size()
    if world % args.cp:
        raise SystemExit(f"--cp {args.cp} must divide the {world} ranks")
    # High-priority NCCL streams for every dim's groups, as kdacp.new_cp_group makes them.
    mesh = kdacp.init_device_mesh(device.type, (world // args.cp, args.cp), mesh_dim_names=("dp", "cp"))
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")

    model.to(device)
    kdacp.parallelize(model, mesh["cp"], loss_group=dp_cp)   # context parallelism first
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_cp)
    fully_shard(model, mesh=dp_cp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    replica = mesh.get_local_rank("dp")
    for step in range(args.steps):
        # Each replica's packed batch: 3 documents, cut across the cp ranks' edges.
        g = torch.Generator().manual_seed(1000 * step + replica)
        ids = torch.randint(3, 128, (1, args.tokens), generator=g)
        cuts = sorted(torch.randperm(args.tokens - 2, generator=g)[:2].add(1).tolist())
        cu_seqlens = torch.tensor([0, *cuts, args.tokens])
        batch = kdacp.shard_batch(ids.to(device), cu_seqlens=cu_seqlens.to(device), group=mesh["cp"])
        loss = model(**batch.model_kwargs()).loss   # the global token mean; gradients ready for FSDP's average
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
