"""The state-summary functions the fast backends call.

They are the reference implementations for now. ``kdacp.kernels`` provides Triton launchers with
the same arguments (called here with keywords); switching is the import below.
"""
from ..reference.summary import state_gradient_summary, state_summary

__all__ = ["state_gradient_summary", "state_summary"]
