"""Megatron-core side: CPU compatibility, model providers, actor/reference, checkpoints.

Together with `megatron_rl.weights`, the only package that imports `megatron.core`.
"""
