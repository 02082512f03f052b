"""The registry of local backends and the one place a call's backend is chosen.

Each backend is a :class:`BackendSpec` (FLA's ``fla/ops/backends`` registry is the model): the families it
serves (``"kda"``, ``"gdn"``), whether it can run on a device and, if not, why (``require`` raises naming
what is missing), its place among ``backend="auto"``'s candidates per family, whether it serves training
calls (autograd) or hands calls that want no gradient to another backend, what it fuses in the layers
(FLA's short convolution and gated norm), the limits of one call (``refusal``: the reason, or None) and a
factory. :func:`choose_backend` resolves ``"auto"`` or a name once per call and returns the spec, or raises
the refusal with its reason. Adding a backend: a module with its :class:`~kdacp.backends.base.LocalBackend`
and one :func:`register_backend` line (docs/ARCHITECTURE.md, "How to add a backend").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import attn_gym_adapter, fla_adapter, flashqla_adapter
from .base import KDAOptions, LocalBackend

FAMILIES = ("kda", "gdn")
# what a backend may fuse in the layers around the recurrence (the layers read it, not a list of names)
LAYER_FUSIONS = frozenset({"short_conv", "gated_norm"})


@dataclass(frozen=True)
class CallFacts:
    """What a spec's ``refusal`` reads of one call: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` (any device,
    meta included: shapes and dtypes only, so every rank decides alike) and the options."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    lower_bound: float | None = None
    summary_precision: str | None = None
    training: bool = False  # the call wants gradients


@dataclass(frozen=True)
class BackendSpec:
    """One local backend, as the registry knows it.

    Attributes:
        name: what ``backend=`` names it by.
        build: ``(options, scalar_gate) -> LocalBackend`` for one call; ``scalar_gate``: run GDN's kernels
            on its gate ``g [1, T, HV]`` (only where :attr:`runs_scalar_gate` says so, ``options.gate`` then
            ``"scalar"``); a scalar gate it does not run is broadcast around the backend built for the per-channel
            one (:func:`kdacp.backends.gate.build_for_gate`).
        families: the op families it serves, of :data:`FAMILIES`.
        devices: the device types it runs on (None: any).
        available: ``(device) -> bool``, cheap, for ``"auto"`` (its packages present, the device right).
        require: ``(device) -> None``, raising ``ValueError`` / ``ImportError`` that names why it cannot run on
            ``device`` (asked for by name); None: it runs on every device of :attr:`devices`.
        auto_priority: family -> its place among ``"auto"``'s candidates (lower first); absent: auto never
            picks it for that family.
        training: it serves calls that want gradients.
        inference: the backend that runs its calls that want no gradient (None: itself).
        fuses: what it fuses in the layers (of :data:`LAYER_FUSIONS`).
        refusal: ``(family, CallFacts) -> reason or None``: a call outside its limits.
        runs_scalar_gate: ``(training) -> bool``: a GDN call runs on its scalar gate (else on the per-channel
            broadcast, KDA's kernels, :class:`kdacp.backends.gate.BroadcastGate`).
    """

    name: str
    build: Callable[[KDAOptions, bool], LocalBackend]
    families: frozenset = frozenset(FAMILIES)
    devices: tuple[str, ...] | None = None
    available: Callable[[torch.device], bool] = lambda device: True
    require: Callable[[torch.device], None] | None = None
    auto_priority: dict = field(default_factory=dict)
    training: bool = True
    inference: str | None = None
    fuses: frozenset = frozenset()
    refusal: Callable[[str, CallFacts], str | None] | None = None
    runs_scalar_gate: Callable[[bool], bool] = lambda training: False

    def check(self, device: torch.device) -> None:
        """Raise, naming why, unless this backend runs on ``device``."""
        if not self.runs_on(device.type):
            kind = " or ".join(t.upper() if t == "cuda" else t for t in self.devices)
            raise ValueError(f"backend={self.name!r} needs {kind} tensors, got device {device}")
        if self.require is not None:
            self.require(device)

    def runs_on(self, device_type: str) -> bool:
        """Whether it runs on devices of ``device_type`` at all (its packages aside)."""
        return self.devices is None or device_type in self.devices

    def availability(self, device: torch.device) -> tuple[bool, str | None]:
        """``(ok, reason)``: whether it runs on ``device`` and, if not, why."""
        try:
            self.check(device)
        except (ImportError, ValueError) as e:
            return False, str(e)
        return True, None


# name -> spec, in registration order (kdacp's own: torch, fla, attn_gym, flashqla)
BACKEND_SPECS: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> BackendSpec:
    """Register ``spec`` under ``spec.name``, which ``backend=`` then accepts.

    Raises:
        ValueError: the name is taken or is ``"auto"``, or a family is not one of :data:`FAMILIES`.
    """
    if spec.name in BACKEND_SPECS or spec.name == "auto":
        raise ValueError(f"backend {spec.name!r} is already registered")
    if not set(spec.families) <= set(FAMILIES) or not set(spec.fuses) <= LAYER_FUSIONS:
        raise ValueError(f"backend {spec.name!r}: families must be some of {FAMILIES} and fuses some of "
                         f"{sorted(LAYER_FUSIONS)}, got {sorted(spec.families)} and {sorted(spec.fuses)}")
    BACKEND_SPECS[spec.name] = spec
    return spec


def backend_choices() -> tuple[str, ...]:
    """``"auto"`` and every registered backend's name."""
    return ("auto",) + tuple(BACKEND_SPECS)


def choose_backend(backend: str, device: torch.device, *, scalar_gate: bool = False,
                   call: CallFacts | None = None) -> BackendSpec:
    """The spec of the backend that runs one call: ``backend`` by name, or for ``"auto"`` the first of the
    family's candidates (by ``auto_priority``) that is available on ``device`` and, given ``call``, does not
    refuse it (GDN: attention-gym's core on a Hopper GPU within its limits, else FLA's kernels on CUDA, else
    the reference; KDA's layer trains faster on FLA's kernels, so auto never picks attention-gym for it).
    ``scalar_gate``: the call is GDN's (one decay per head). Shapes, dtypes and options only, so every rank
    chooses alike.

    Raises:
        ValueError: unknown name; a backend that does not serve the family, cannot run on ``device``
            (``"fla"`` or ``"attn_gym"`` for a non-CUDA device, ``"attn_gym"`` on a GPU other than Hopper), or
            refuses ``call`` (asked for by name; the message names the limit).
        ImportError: a backend asked for by name whose packages are missing (the message names them).
    """
    if backend not in backend_choices():
        raise ValueError(f"backend must be one of {backend_choices()}, got {backend!r}")
    family = "gdn" if scalar_gate else "kda"
    if backend == "auto":
        candidates = sorted((s for s in BACKEND_SPECS.values() if family in s.auto_priority),
                            key=lambda s: s.auto_priority[family])
        for spec in candidates:
            if spec.runs_on(device.type) and spec.available(device) and _call_refusal(spec, family, call) is None:
                return spec
        raise ValueError(f"backend='auto': no registered backend runs this {family} call on {device}")
    spec = BACKEND_SPECS[backend]
    if family not in spec.families:
        raise ValueError(f"backend={backend!r} does not serve {family.upper()} calls (it serves "
                         f"{', '.join(sorted(f.upper() for f in spec.families))})")
    spec.check(device)
    reason = _call_refusal(spec, family, call)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run this call: {reason}")
    return spec


def _call_refusal(spec: BackendSpec, family: str, call: CallFacts | None) -> str | None:
    if call is None:
        return None
    if call.training and not spec.training:
        return "it serves inference only (calls that want no gradient)"
    return None if spec.refusal is None else spec.refusal(family, call)


def backend_fuses(backend: str, device: torch.device, *, scalar_gate: bool = False) -> frozenset:
    """What the backend ``backend`` resolves to on ``device`` fuses in the layers (:data:`LAYER_FUSIONS`); raises
    as :func:`choose_backend`."""
    return choose_backend(backend, device, scalar_gate=scalar_gate).fuses


# ---------------------------------------------------------------------------------------------
# kdacp's own backends


def _build_torch(options: KDAOptions, scalar_gate: bool) -> LocalBackend:
    if scalar_gate:
        raise ValueError("backend 'torch' runs GDN on the per-channel broadcast of its gate, not on scalar_gate")
    from .torch_backend import TorchBackend
    return TorchBackend(options)


def _build_fla(options: KDAOptions, scalar_gate: bool) -> LocalBackend:
    if scalar_gate:
        from .fla_gdn_backend import FlaGDNBackend
        return FlaGDNBackend(options)
    from .fla_backend import FlaBackend
    return FlaBackend(options)


def _build_attn_gym(options: KDAOptions, scalar_gate: bool) -> LocalBackend:
    from .attn_gym_backend import AttnGymBackend, AttnGymGDNBackend
    return AttnGymGDNBackend(options) if scalar_gate else AttnGymBackend(options)


def _require_attn_gym(device: torch.device) -> None:
    fla_adapter.require_fla()
    attn_gym_adapter.require_attn_gym()
    if not attn_gym_adapter.attn_gym_device_supported(device):
        raise ValueError(f"backend='attn_gym' runs on GPUs of capability {attn_gym_adapter.SUPPORTED_CAPABILITY} "
                         f"(Hopper), got {torch.cuda.get_device_capability(device)} on {device}; use backend='fla'")


def _attn_gym_refusal(family: str, call: CallFacts) -> str | None:
    return attn_gym_adapter.attn_gym_refusal(
        call.q, call.k, call.v, scalar_gate=family == "gdn", use_qk_l2norm_in_kernel=call.use_qk_l2norm_in_kernel,
        use_gate_in_kernel=call.use_gate_in_kernel, lower_bound=call.lower_bound,
        summary_precision=call.summary_precision)


register_backend(BackendSpec("torch", _build_torch, auto_priority={"kda": 2, "gdn": 2}))
register_backend(BackendSpec(
    "fla", _build_fla, devices=("cuda",), available=lambda device: fla_adapter.fla_available(),
    require=lambda device: fla_adapter.require_fla(), auto_priority={"kda": 1, "gdn": 1}, fuses=LAYER_FUSIONS,
    # FLA refuses its GDN backward in some versions (fla_gated_gdn_backward_supported): a training GDN call
    # then runs FLA's KDA kernels on the broadcast gate (same math, slower)
    runs_scalar_gate=lambda training: not training or fla_adapter.fla_gated_gdn_backward_supported()))
register_backend(BackendSpec(
    # GDN trains faster on attention-gym's core (0.68x of the layer's time on FLA's kernels, 16K tokens, one H200);
    # KDA does not (15.01 against 14.51 ms), so auto picks it for GDN only. Its forward is no faster than FLA's
    # (2.220 / 2.243 ms KDA and 1.148 / 1.832 ms GDN, FLA / attention-gym): calls that want no gradient run on FLA.
    "attn_gym", _build_attn_gym, devices=("cuda",),
    available=lambda device: (attn_gym_adapter.attn_gym_device_supported(device) and fla_adapter.fla_available()
                              and attn_gym_adapter.attn_gym_available()),
    require=_require_attn_gym, auto_priority={"gdn": 0}, training=True, inference="fla", fuses=LAYER_FUSIONS,
    refusal=_attn_gym_refusal, runs_scalar_gate=lambda training: True))


def _build_flashqla(options: KDAOptions, scalar_gate: bool) -> LocalBackend:
    from .flashqla_backend import FlashQLAGDNBackend
    return FlashQLAGDNBackend(options)


def _require_flashqla(device: torch.device) -> None:
    fla_adapter.require_fla()
    flashqla_adapter.require_flashqla()
    if not flashqla_adapter.flashqla_device_supported(device):
        raise ValueError(f"backend='flashqla' runs on GPUs of capability {flashqla_adapter.SUPPORTED_CAPABILITIES} "
                         f"(Hopper, Blackwell), got {torch.cuda.get_device_capability(device)} on {device}; use "
                         "backend='fla'")


register_backend(BackendSpec(
    # GDN only; not among auto's candidates until measured against FLA's and attention-gym's on a GPU
    # (benchmarks/split_heads.py)
    "flashqla", _build_flashqla, families=frozenset({"gdn"}), devices=("cuda",),
    available=lambda device: (flashqla_adapter.flashqla_device_supported(device) and fla_adapter.fla_available()
                              and flashqla_adapter.flashqla_available()),
    require=_require_flashqla, fuses=LAYER_FUSIONS,
    refusal=lambda family, call: flashqla_adapter.flashqla_refusal(call.q, call.k, call.v),
    runs_scalar_gate=lambda training: True))
