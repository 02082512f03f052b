"""Triton kernels for the affine state summaries exchanged between context-parallel ranks.

Launchers validate their inputs (raising ``TypeError``/``ValueError`` naming the argument) before any
kernel runs; every summary is float32. The math, and the plain-PyTorch version every kernel is tested
against, are in :mod:`kdacp.reference.summary`.
"""
from .state_gradient import state_gradient_summary
from .state_summary import state_summary, transition
from .config import SummaryConfig

__all__ = ["SummaryConfig", "state_gradient_summary", "state_summary", "transition"]
