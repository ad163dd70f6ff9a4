"""Training and evaluation data: record schemas, source readers (IgakuQA, MedMCQA), prompts.

Everything here imports only the standard library so that `megatron-rl data ...` and the reward
functions stay cheap to import (no torch).
"""

from megatron_rl.data.schema import DataError, PromptRecord, ReadStats, SFTRecord

__all__ = ["DataError", "PromptRecord", "ReadStats", "SFTRecord"]
