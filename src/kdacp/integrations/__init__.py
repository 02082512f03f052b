"""kdacp inside other trainers, applied from outside their code (each needs its extra, e.g. ``kdacp[torchtitan]``).

:mod:`kdacp.integrations.torchtitan`: context parallelism for torchtitan 0.3.0's Qwen3.5.
"""
