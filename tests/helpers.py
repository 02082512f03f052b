"""Random KDA inputs and error measures shared by the tests."""
from __future__ import annotations

import contextlib
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(monkeypatch, capsys, script: str, *args: str) -> subprocess.CompletedProcess:
    """``python benchmarks/<script>.py *args`` run in this process, without the second interpreter's start and
    imports (seconds a call): its exit status, stdout and stderr, as ``subprocess.run(..., capture_output=True,
    text=True)`` returns them.

    The script runs as ``__main__`` (:func:`runpy.run_path`) with ``sys.argv`` set and ``benchmarks/`` first on
    ``sys.path``, as ``python benchmarks/<script>.py`` runs it; ``monkeypatch`` puts both back after the test and
    ``capsys`` gives what it printed. The exit status is the ``SystemExit`` it raised (``None``: 0; a message:
    printed to stderr, 1, as Python does) or 0 when it returned; any other exception propagates.

    Only for runs that leave this process as they found it, such as a refusal of bad arguments: a script that
    changes process state at import, or a run that gets past its argument checks to set environment variables,
    torch's thread count or Triton's interpreter, start a process group or spawn workers, runs in a subprocess.
    """
    path = BENCHMARKS / f"{script}.py"
    argv = [str(path), *args]
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", argv)
    capsys.readouterr()  # what the test printed before: not the script's
    try:
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        err, code = f"{err}{code}\n", 1
    return subprocess.CompletedProcess(argv, code, out, err)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``0`` when both are zero)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def zeroed_outputs(fn):
    """``fn`` with every tensor it returns zeroed (a tensor, a list of tensors or Nones, or None): a mechanism
    removed while its messages still flow, for the tests that show a check fails without it."""
    def zeros(out):
        if isinstance(out, (list, tuple)):
            return type(out)(zeros(x) for x in out)
        return None if out is None else torch.zeros_like(out)

    return lambda *args, **kwargs: zeros(fn(*args, **kwargs))


def random_cu_seqlens(T: int, num_seqs: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[0, ..., T]`` with ``min(num_seqs, T)`` sequences cut at random points."""
    n = min(num_seqs, T)
    cuts = torch.randperm(T - 1, generator=generator)[: n - 1] + 1 if n > 1 else torch.tensor([], dtype=torch.long)
    return torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([T])]).long()


def make_kda_inputs(B, T, H, HV, K, V, *, dtype=torch.float64, gate="plain", initial_state=False,
                    cu_seqlens=None, requires_grad=True, device="cpu", seed=None, gate_shift=0.0):
    """Fresh random inputs for ``chunk_kda``-style calls as a kwargs dict.

    ``gate``: ``"plain"`` (natural-log decay given, pre-normalised k), ``"default"``
    (``-exp(A_log) softplus``) or ``"safe"`` (lower bound -5); the last two use the gate and the
    L2 norm in kernel. ``gate_shift`` is added to the gate logits of the last two: at 0 a state fades
    within a few tokens (K=V=16: the largest entry of a 40-token span's transition 3e-11, of 120 tokens
    5e-30), at -4 it lasts (0.24 and 5e-3), so that what crosses a rank boundary weighs on the result.
    Leaf tensors require grad when ``requires_grad``.
    """
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
    beta = torch.sigmoid(rnd(B, T, HV))
    args = dict(q=q, k=k, v=v, beta=beta)
    if gate == "plain":
        args["k"] = F.normalize(k, dim=-1)
        args["q"] = F.normalize(q, dim=-1)
        args["g"] = F.logsigmoid(rnd(B, T, HV, K) + 2.0)
    else:
        args["g"] = rnd(B, T, HV, K) + gate_shift
        args["A_log"] = 0.5 * rnd(HV)
        args["dt_bias"] = 0.5 * rnd(HV * K)
    if initial_state:
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        args["initial_state"] = rnd(N, HV, K, V) * 0.5
    args = {name: x.to(device=device, dtype=dtype).requires_grad_(requires_grad) for name, x in args.items()}
    if gate != "plain":
        args.update(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
        if gate == "safe":
            args["lower_bound"] = -5.0
    if cu_seqlens is not None:
        args["cu_seqlens"] = cu_seqlens.to(device)
    return args


def differentiable_inputs(args: dict) -> dict:
    """The tensors of ``args`` that require grad, by name."""
    return {n: x for n, x in args.items() if isinstance(x, torch.Tensor) and x.requires_grad}


@contextlib.contextmanager
def count_signature_gathers():
    """Count calls of the cross-rank check's all-gather (``kdacp.cp.collectives``) inside the block;
    yields the list that grows by one per call."""
    from kdacp.cp import collectives
    gathers, real = [], collectives.all_gather_signatures
    collectives.all_gather_signatures = lambda *a: gathers.append(1) or real(*a)
    try:
        yield gathers
    finally:
        collectives.all_gather_signatures = real


class _FakeEvent:
    """A CUDA event on a fake device clock: recorded at the clock's time; done once the device passed it."""

    def __init__(self, clock, enable_timing=False):
        self.clock, self.t = clock, None

    def record(self):
        self.t = self.clock["queued"]

    def query(self):
        return self.clock["device_done"] >= self.t

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def fake_cuda_clock(monkeypatch) -> dict:
    """A fake device for the timing code's GPU branches on the CPU: ``torch.cuda.Event`` reads a clock
    that moves as work is queued (``clock["queued"]``, seconds; a sleep of ``c`` cycles adds ``c / 2e9``),
    and the device has run everything queued only after ``torch.cuda.synchronize()``."""
    clock = {"queued": 0.0, "device_done": -1.0}
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _FakeEvent(clock, enable_timing))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: clock.update(queued=clock["queued"] + cycles / 2e9))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: clock.update(device_done=clock["queued"]))
    return clock


class ListIndexing(TorchFunctionMode):
    """Records (as ``file:line``) each tensor indexing by a Python list made by kdacp code whose path contains
    ``where`` (default: ``kdacp/cp/``)."""

    def __init__(self, where: str = os.path.join("kdacp", "cp") + os.sep):
        super().__init__()
        self.where, self.found = where, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _is_host_list(args[1]):
            caller = _first_kdacp_frame()
            if caller is not None and self.where in caller:
                self.found.append(caller)
        return func(*args, **(kwargs or {}))


def _is_host_list(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) for p in parts)


def _first_kdacp_frame() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if os.sep + "kdacp" + os.sep in name and "host_copies" not in name:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


# Tensor methods and functions that bring a tensor's values to the host (a device sync for a CUDA tensor).
_VALUE_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
                          torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.numpy, torch.Tensor.cpu,
                          torch.Tensor.equal, torch.equal, torch.Tensor.allclose, torch.allclose})


class HostReads(TorchFunctionMode):
    """Records (as ``kdacp file:line`` stacks) every read of device values to the host that kdacp code makes: the
    host syncs a CUDA run would have, seen on the CPU. Device tensors are those given to :meth:`on_device` (a
    layer's inputs and parameters), the copies :func:`kdacp.host_copies.to_device` makes (on the CPU a copy of
    its own, apart from the host tensor), and everything computed from them; a read is :data:`_VALUE_READS` or
    ``.to("cpu")`` of one. Host tensors (boundaries a context keeps on the host) read freely."""

    def __init__(self):
        super().__init__()
        self.found, self._device, self._kept = [], set(), []

    def on_device(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._device.add(id(t))
            self._kept.append(t)  # alive while recorded: no id is reused

    def _touches_device(self, args, kwargs) -> bool:
        flat = list(args) + list((kwargs or {}).values())
        flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
        return any(isinstance(a, torch.Tensor) and id(a) in self._device for a in flat)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.Tensor.to and any(str(a) == "cpu" for a in [*args[1:], *kwargs.values()])
        made_by_to_device = func is torch.Tensor.to and "host_copies" in sys._getframe(1).f_code.co_filename
        device_input = self._touches_device(args, kwargs)
        if device_input and (func in _VALUE_READS or to_host and not made_by_to_device):
            stack = [f"{f.filename.split(os.sep + 'kdacp' + os.sep)[-1]}:{f.lineno}" for f in traceback.extract_stack()
                     if os.sep + "kdacp" + os.sep in f.filename]
            if stack:
                self.found.append(" < ".join(reversed(stack[-4:])))
        out = func(*args, **kwargs)
        if device_input or made_by_to_device:
            outs = out if isinstance(out, (list, tuple)) else (out,)
            self.on_device(*(o for o in outs if isinstance(o, torch.Tensor)))
        return out
