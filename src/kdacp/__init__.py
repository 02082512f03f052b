"""kdacp: context-parallel Kimi Delta Attention for PyTorch."""
__version__ = "0.1.0"
