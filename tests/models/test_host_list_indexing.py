"""A parallelised Hugging Face model's step under zigzag indexes no tensor by a Python list anywhere in kdacp
(layers, softmax attention, convolution halo, the state chain): on a GPU such an index is a copy from pageable
memory that makes the host wait for the device's queue (:mod:`kdacp.host_copies`). Its second step is watched,
after a first that builds the batch's context."""
from __future__ import annotations

import os

import torch

from tests.multiprocess import run_ranks
from tests.helpers import ListIndexing


def _worker(rank, world_size, found):
    import kdacp
    from tests.models.cp_common import CU_SEQLENS, tokens
    from tests.models.test_kimi_linear_cp import _model
    mesh = kdacp.init_device_mesh("cpu", (world_size,))
    model = kdacp.parallelize(_model(attn_implementation="sdpa"), mesh, layout="zigzag")
    batch = kdacp.shard_batch(tokens(), cu_seqlens=torch.tensor(CU_SEQLENS), layout="zigzag")
    model(**batch.model_kwargs()).loss.backward()
    with ListIndexing(os.sep + "kdacp" + os.sep) as mode:
        model(**batch.model_kwargs()).loss.backward()
    found.extend(mode.found)


def test_a_zigzag_model_step_indexes_no_tensor_by_a_host_list():
    found = torch.multiprocessing.Manager().list()
    run_ranks(_worker, 2, found)
    assert list(found) == []
