"""Train a small Megatron-Core GPTModel of Gated DeltaNet layers with kdacp's GDN at any context-parallel size.

    torchrun --nproc-per-node 2 examples/megatron_gdn_cp.py                 # CPU (gloo), cp = 2
    torchrun --nproc-per-node 4 examples/megatron_gdn_cp.py --packed        # cp = 4 > the 2 key heads, THD
    torchrun --nproc-per-node 8 examples/megatron_gdn_cp.py --seq-len 65536 # GPUs (NCCL), cp = 8

Every rank is one context-parallel rank (tp = pp = dp = 1). The model is Megatron's ``GPTModel`` built from
:func:`kdacp.integrations.megatron.get_hybrid_block_spec` (all layers GDN here: Megatron's hybrid attention
layers need Transformer Engine), with :class:`~kdacp.integrations.megatron.KdacpTransformerConfig` so that
cp may exceed the GDN head count. Each rank feeds Megatron's zigzag shard of the batch (Megatron's
per-sequence split; per document for ``--packed``); the loss is the rank's summed token loss over the global
token count and the gradients are summed over cp (what Megatron's DDP does over dp x cp), so every step is
the step of one device on the whole batch. The task: continue a cycle of tokens of period
``--period`` (each document entering it at a random phase).

Needs megatron-core 0.19.2 (on Python 3.11: ``pip install --no-deps --ignore-requires-python
megatron-core==0.19.2``); on GPUs FLA (``kdacp[fla]``) for the fast local kernels, else kdacp's PyTorch path.
"""
from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # on CPU Megatron's torch.compile'd fusions run eagerly

import argparse  # noqa: E402
import contextlib  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.backends import LocalSpecProvider  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402

from kdacp.integrations import megatron as km  # noqa: E402


def build_model(cp: int, layers: int, vocab: int, seq_len: int, on_gpu: bool) -> GPTModel:
    """``layers`` GDN layers (2 key heads, 4 value heads of 32), dense SwiGLU MLPs, Megatron's local layers."""
    config = km.KdacpTransformerConfig(
        num_layers=layers, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1] * layers,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, normalization="RMSNorm", activation_func=F.silu, gated_linear_unit=True,
        context_parallel_size=cp, use_cpu_initialization=not on_gpu, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16 if on_gpu else torch.float32, bf16=on_gpu)
    spec = km.get_hybrid_block_spec(config, LocalSpecProvider())
    with contextlib.nullcontext() if on_gpu else km.cpu_stand_ins():
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq_len,
                         position_embedding_type="none", pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    return model.cuda() if on_gpu else model


def batch(step: int, seq_len: int, period: int, vocab: int, documents: int):
    """``documents`` sequences of ``seq_len / documents`` tokens: one fixed cycle of ``period`` distinct tokens,
    each document entering it at a random phase; inputs, next-token labels and the global document boundaries."""
    cycle = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:period]
    g = torch.Generator().manual_seed(1 + step)
    length = seq_len // documents
    phases = torch.randint(0, period, (documents, 1), generator=g)
    tokens = cycle[(phases + torch.arange(length + 1)) % period]
    cu = torch.arange(documents + 1, dtype=torch.int32) * length
    return tokens[:, :-1].reshape(1, -1), tokens[:, 1:].reshape(1, -1), cu


def zigzag_shard(x: torch.Tensor, cu: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's zigzag shard of ``x [1, T]``: per document ``2 cp`` chunks, chunks ``rank`` and ``2cp-1-rank``."""
    parts = []
    for s, e in zip(cu.tolist(), cu[1:].tolist()):
        c = (e - s) // (2 * cp)
        parts += [x[:, s + rank * c:s + (rank + 1) * c], x[:, s + (2 * cp - 1 - rank) * c:s + (2 * cp - rank) * c]]
    return torch.cat(parts, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=512, help="global tokens a step (divisible by 2 x cp x docs)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--period", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--packed", action="store_true", help="THD batches of 4 documents (PackedSeqParams)")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    torch.manual_seed(0)
    if on_gpu:
        model_parallel_cuda_manual_seed(0)
    model = build_model(cp, args.layers, args.vocab, args.seq_len, on_gpu)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    documents = 4 if args.packed else 1
    device = torch.device("cuda" if on_gpu else "cpu")
    for step in range(args.steps):
        tokens, labels, cu = batch(step, args.seq_len, args.period, args.vocab, documents)
        psp = None
        if args.packed:
            cu = cu.to(device)
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                  max_seqlen_q=args.seq_len // documents, max_seqlen_kv=args.seq_len // documents)
        tokens, labels = (zigzag_shard(t, cu.cpu(), cp, rank).to(device) for t in (tokens, labels))
        optimizer.zero_grad()
        loss = model(tokens, None, None, labels=labels, packed_seq_params=psp).float().sum() / (args.seq_len)
        loss.backward()
        for p in model.parameters():  # the sum over cp of each rank's share: the whole batch's gradient
            dist.all_reduce(p.grad)
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
