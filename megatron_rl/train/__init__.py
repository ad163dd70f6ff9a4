"""The RL training loop (`megatron-rl train`): phases in their own modules, the loop in loop.py."""
