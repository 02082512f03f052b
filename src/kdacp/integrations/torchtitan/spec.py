"""The trainer, model spec and configs of kdacp's Qwen3.5 (what ``--module kdacp.integrations.torchtitan`` names):
:class:`KdacpTrainer` (batches cut by :func:`~.batch.shard_batch`), :func:`model_registry`, :func:`text_config` and
the ``qwen35_*`` configs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models import qwen3_5
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from .batch import shard_batch
from .parallelize import SPEC_NAME, parallelize_qwen3_5_kdacp

# Token ids no token has: Qwen3.5 reads them only to place vision embeddings.
TEXT_ONLY_TOKENS = {"image_id": -1, "video_id": -1}


class KdacpTrainer(Trainer):
    """torchtitan's ``Trainer`` for Qwen3.5 on text batches, cut by :func:`shard_batch` under context
    parallelism. Qwen3.5's forward looks up the image and video token ids even without vision inputs;
    torchtitan's text loader has none, so text batches get :data:`TEXT_ONLY_TOKENS`."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def post_dataloading_process(self, input_dict, labels):
        if self.parallel_dims.cp_enabled:
            inputs, labels, kwargs = shard_batch(self.model_parts[0], input_dict, labels,
                                                 self.parallel_dims.get_mesh("cp"))
            self.ntokens_seen += labels.numel()
        else:
            inputs, labels, kwargs = super().post_dataloading_process(input_dict, labels)
        kwargs.setdefault("special_tokens", TEXT_ONLY_TOKENS)
        return inputs, labels, kwargs


def model_registry(flavor: str, attn_backend: str = "flex", **kwargs) -> ModelSpec:
    """torchtitan's Qwen3.5 spec of ``flavor`` (its ``model_registry`` arguments), named ``qwen3_5_kdacp``
    and parallelized by :func:`parallelize_qwen3_5_kdacp`; the model and its state dict are torchtitan's."""
    spec = qwen3_5.model_registry(flavor, attn_backend=attn_backend, **kwargs)
    return dataclasses.replace(spec, name=SPEC_NAME, parallelize_fn=parallelize_qwen3_5_kdacp)


def text_config(spec: ModelSpec, *, seq_len: int, steps: int, local_batch_size: int = 1,
                trainer: type[Trainer] = Trainer) -> Trainer.Config:
    """A trainer config for ``spec`` on text, with the settings of torchtitan's Qwen3.5 configs (chunked
    cross-entropy, AdamW at 5e-3, linear warm-up, selective activation checkpointing, a checkpoint at
    the last step when enabled), without CUDA graphs (kdacp's spec refuses them), and torchtitan's
    text loader (``c4_test``: a local ``{"text": ...}`` dataset at ``dataloader.dataset_path``) and
    tokenizer (``tokenizer.json`` at ``hf_assets_path``). Written out here because torchtitan's Qwen3.5
    config module needs torchvision for its image loader."""
    return trainer.Config(
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        tokenizer=HuggingFaceTokenizer.Config(),
        model_spec=spec,
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        optimizer=default_adamw(lr=5e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        metrics=MetricsProcessor.Config(log_freq=1),
        training=TrainingConfig(local_batch_size=local_batch_size, seq_len=seq_len, steps=steps,
                                disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(interval=steps, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
    )


def qwen35_kdacp_debugmodel() -> KdacpTrainer.Config:
    """torchtitan's Qwen3.5 ``debugmodel`` (8 layers, dim 256) on text with kdacp's spec, 512 tokens, 10 steps."""
    return text_config(model_registry("debugmodel"), seq_len=512, steps=10, trainer=KdacpTrainer)


def qwen35_kdacp_0_8b() -> KdacpTrainer.Config:
    """torchtitan's Qwen3.5 ``0.8B`` (24 layers, dim 1024) on text with kdacp's spec, 16K tokens, 20 steps."""
    return text_config(model_registry("0.8B"), seq_len=16384, steps=20, trainer=KdacpTrainer)


def qwen35_titan_0_8b() -> KdacpTrainer.Config:
    """torchtitan's own Qwen3.5 ``0.8B`` spec with :func:`qwen35_kdacp_0_8b`'s settings (the baseline; without
    context parallelism :class:`KdacpTrainer` only adds :data:`TEXT_ONLY_TOKENS` to torchtitan's batches)."""
    return text_config(qwen3_5.model_registry("0.8B"), seq_len=16384, steps=20, trainer=KdacpTrainer)
