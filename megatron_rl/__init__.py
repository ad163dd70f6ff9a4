"""megatron-rl: Megatron-LM-native RL post-training recipes (GRPO, GSPO, CHORD)."""

__version__ = "0.1.0"
