"""MedXpertQA: evaluation prompts (`data.py`), scored by `megatron-rl eval mcq`."""
