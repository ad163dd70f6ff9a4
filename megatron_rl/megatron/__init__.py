"""Megatron-core side: CPU compatibility, the GPT building blocks of the model providers,
actor/reference, checkpoints.

Together with `megatron_rl.weights` and the model folders' providers, the only code that imports
`megatron.core`.
"""
