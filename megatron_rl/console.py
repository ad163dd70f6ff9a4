"""What a person reads on the console: known third-party noise filtered, one start-up summary,
step lines with a progress bar and an ETA. Standard library only.

`quiet_third_party()` is called by our entry points (`cli.main`, the conversion workers), never
on import, so a library user's own warning settings stay theirs. It removes only the messages
listed below, each matched by category, text and the module that raises it; every other
warning, ours included, still shows.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

# (category, message regex, module regex) passed to `warnings.filterwarnings("ignore", ...)`.
KNOWN_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    # megatron-core's import-time notices that it runs without Transformer Engine / Apex (CPU runs,
    # and GPU images without Apex): it falls back to torch implementations, as intended.
    (UserWarning, r"(Transformer Engine and Apex are|Apex is) not installed", r"megatron\.core(\.|$)"),
    # TransformerConfig's own default cuda_graph_modules="full" warns about itself.
    (UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config"),
    (UserWarning, r"MimoModelConfig is experimental", r"megatron\.core\.models\.mimo(\.|$)"),
    # megatron-core calls torch's old collective names; torch points at the caller's frame.
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated", r"torch\.distributed(\.|$)"),
    # The distributed optimizer zeroes the grads of its fp32 shard views (megatron marks the line
    # "throws grad-access warning"); the view's .grad is None either way.
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf", r"megatron\.core\.optimizer(\.|$)"),
    # Deprecations Python hides outside __main__ but pytest shows: megatron-core's own imports.
    (DeprecationWarning, r"`torch\.jit\.script_method` is deprecated", r"torch\.jit(\.|$)"),
    (DeprecationWarning, r"The following imports from `dynamic_context\.py`", r"megatron\.core\.inference(\.|$)"),
)
# (logger name, message prefix): megatron-core messages written with `logging`, not `warnings`.
KNOWN_LOG_LINES: tuple[tuple[str, str], ...] = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel: full_param_layout"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
    # torchao (imported by transformers' quantizer table whenever it is installed) tries its CUDA
    # kernels' .so files on every import; on CPU they cannot load and are not needed.
    ("torchao", "Failed to load "),
    # torchao registers its enums as pytree constants, which torch 2.13 deprecates (torch's own log).
    ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported"),
)


class _DropPrefixes(logging.Filter):
    def __init__(self, prefixes: Iterable[str]) -> None:
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_third_party() -> None:
    """Hide the known third-party warnings and log lines above and transformers' progress bars
    (writing and loading the tiny checkpoints; our own bars and step lines stay). Idempotent.
    A person who sets HF_HUB_DISABLE_PROGRESS_BARS=0 keeps the bars."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # read when transformers is imported
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] not in ("0", "false", "False"):
        hf_logging.disable_progress_bar()                         # already imported: switch it off now
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    by_logger: dict[str, list[str]] = {}
    for name, prefix in KNOWN_LOG_LINES:
        by_logger.setdefault(name, []).append(prefix)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes(prefixes))


def known_noise(line: str) -> bool:
    """Is `line` one of the filtered messages? (For tests that check a console stays quiet.)"""
    return any(re.search(message, line) for _, message, _ in KNOWN_WARNINGS) or \
        any(line.startswith(prefix) or f" {prefix}" in line for _, prefix in KNOWN_LOG_LINES)


def summary(rows: Iterable[tuple[str, str]]) -> str:
    """The start-up block: one aligned `key  value` line per row."""
    rows = list(rows)
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def clock(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


@dataclass
class Progress:
    """Steps `first..total` of a run: a bar, elapsed time and an ETA from the mean step time so far
    (a resumed run counts only the steps it ran itself)."""

    first: int
    total: int
    width: int = 20
    started: float = 0.0

    def __post_init__(self) -> None:
        self.started = self.started or time.monotonic()

    def line(self, step: int, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.monotonic()) - self.started
        done = step - self.first + 1
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        filled = round(self.width * step / self.total) if self.total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        return f"[{bar}] {step}/{self.total} {clock(elapsed)} < {clock(eta)}"
