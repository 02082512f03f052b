"""Triton kernels for the affine state summaries exchanged between context-parallel ranks.

Launchers validate their inputs (raising ``TypeError``/``ValueError`` naming the argument) before any
kernel runs; every summary is float32. The gate is KDA's per channel (``gc [B, T, HV, K]``) or GDN's
scalar per token and head (``gc [B, T, HV]``, its own kernel variant). The math, and the plain-PyTorch
version every kernel is tested against, are in :mod:`kdacp.reference.summary`.

Modules: ``state_summary`` / ``state_gradient`` (the kernels and their launchers), ``summary_launcher``
(their shared host side), ``subsegments`` (their work lists), ``pipelining`` (pipeline stages that fit),
``compose`` (the fold kernel), ``tiles`` (shared Triton helpers), ``precision`` (:class:`SummaryPrecision`, the policy
of their products, and the products themselves), ``checks`` (input checks), ``config``
(:class:`SummaryConfig`); ``short_conv`` (the layers' depthwise short convolution, forward and
backward, with its own launchers: :func:`kdacp.kernels.short_conv.fused_causal_conv1d`).
"""
from .state_gradient import state_gradient_summary
from .state_summary import state_summary, transition
from .config import SummaryConfig
from .precision import SummaryPrecision

__all__ = ["SummaryConfig", "SummaryPrecision", "state_gradient_summary", "state_summary", "transition"]
