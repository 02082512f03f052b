"""The state-summary functions the fast (CUDA) backends call: the Triton launchers of
:mod:`kdacp.kernels`, which take the reference functions' arguments (called here with keywords)."""
from ..kernels import state_gradient_summary, state_summary

__all__ = ["state_gradient_summary", "state_summary"]
