"""kdacp inside other trainers, applied from outside their code (each needs its extra, e.g. ``kdacp[torchtitan]``).

:mod:`kdacp.integrations.torchtitan`: context parallelism for torchtitan 0.3.0's Qwen3.5.
:mod:`kdacp.integrations.megatron`: kdacp's Gated DeltaNet as a module of Megatron-Core 0.19.2's layer specs.
"""
