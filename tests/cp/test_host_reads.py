"""A layer's step reads no device value on the host once its batch's context is built: the boundaries reach the
host once, when the context is built, and every later layer call of the batch (forward and backward, the
convolution's halo exchange, the state exchange, the torch backend's recurrence) works from the context's host
copies and device tensors. Seen on the CPU by :class:`tests.helpers.HostReads` (the reads that would be host
syncs on a GPU); :mod:`tests.test_host_copies` checks the op's step on a GPU with CUDA's own sync detector."""
from __future__ import annotations

import os

import pytest
import torch

from kdacp.cp.layout import make_layout
from kdacp.host_copies import to_device
from tests.helpers import HostReads
from tests.multiprocess import run_ranks

CU = (0, 40, 100, 128)


def test_the_detector_sees_device_reads_and_only_those():
    x, host = torch.randn(4), torch.tensor([0, 3])
    probe = compile("x.sum().item(); host.tolist(); device.tolist(); int(x[0] > 0)",
                    os.path.join("src", "kdacp", "cp", "probe.py"), "exec")
    with HostReads() as mode:
        mode.on_device(x)
        exec(probe, {"x": x, "host": host, "device": to_device(host, torch.device("cpu"))})
    assert len(mode.found) == 3  # x's sum, the device copy, x's comparison; not the host tensor


def _layer_step_reads(layer, x: torch.Tensor, cu: torch.Tensor) -> list[str]:
    """The host reads of one forward and backward of ``layer`` after a first one (which builds the context)."""
    for step in range(2):
        leaf = x.detach().requires_grad_()
        with HostReads() as mode:
            mode.on_device(leaf, cu, *layer.parameters())
            o = layer(leaf, cu_seqlens=cu)
            o = o[0] if isinstance(o, tuple) else o
            o.square().sum().backward()
    return mode.found


def _layer(family: str, cp=None):
    import kdacp
    cls = kdacp.KimiDeltaAttention if family == "kda" else kdacp.GatedDeltaNet
    torch.manual_seed(0)
    return cls(hidden_size=32, num_heads=2, head_k_dim=16, head_v_dim=16, backend="torch", cp=cp).double()


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_a_one_device_layer_call_reads_nothing_on_the_host(family):
    x = torch.randn(1, CU[-1], 32, dtype=torch.float64)
    assert _layer_step_reads(_layer(family), x, torch.tensor(CU)) == []


def _zigzag_rank(rank: int, world_size: int, family: str) -> None:
    import kdacp
    layer = _layer(family, kdacp.ContextParallel("state", layout="document_zigzag"))
    T = make_layout("document_zigzag", world_size, CU[-1], CU).local_lengths[rank]
    x = torch.randn(1, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    found = _layer_step_reads(layer, x, torch.tensor(CU))
    assert found == [], f"rank {rank} read device values on the host: {found}"


@pytest.mark.parametrize("family", ["kda", pytest.param("gdn", marks=pytest.mark.slow)])
def test_a_zigzag_rank_layer_call_reads_nothing_on_the_host(family):
    run_ranks(_zigzag_rank, 2, family)
