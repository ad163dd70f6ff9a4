"""A conversion job as plain data: direction, paths, the worker layout, and the checks that run
before any worker starts. Shared by the launcher and the workers (torch-free).

World size: Megatron lays dense weights on a tp × pp × dp grid and expert weights on an
etp × ep × edp × pp grid over the *same* ranks. The converter uses the smallest world on which both
fit: `pp × lcm(tp, ep × etp)` (etp defaults to tp, as in Megatron). With ep × etp dividing tp that
is tp × pp (dense dp = 1); otherwise dense weights are replicated over dp = lcm/tp ranks, which
read the same HF tensors and are deduplicated when saving (EP 8 at TP 1 runs 8 workers, each
holding all dense weights and 1/8 of the experts). A converted checkpoint records the layout's
fields as `conversion_layout`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HF_TO_MCORE = "hf-to-mcore"
MCORE_TO_HF = "mcore-to-hf"
DIRECTIONS = (HF_TO_MCORE, MCORE_TO_HF)
COMPLETE = "complete.json"          # = megatron.checkpoint.COMPLETE (not imported: that pulls megatron)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' classic default "5GB"
MAX_LISTED_PROBLEMS = 50


class ConversionError(ValueError):
    """The source does not match the model, or the job is invalid; `problems` lists every mismatch."""

    def __init__(self, summary: str, problems: list[str] | None = None) -> None:
        self.summary, self.problems = summary, list(problems or [])
        super().__init__(summary)

    def __str__(self) -> str:
        shown = self.problems[:MAX_LISTED_PROBLEMS]
        lines = [self.summary] + [f"  {p}" for p in shown]
        if len(self.problems) > len(shown):
            lines.append(f"  ... and {len(self.problems) - len(shown)} more")
        return "\n".join(lines)


@dataclass(frozen=True)
class ConvertLayout:
    """The Megatron layout the workers build the model at (expert TP defaults to TP)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    def world_size(self) -> int:
        if min(self.tp, self.pp, self.ep, self.expert_tp) < 1:
            raise ConversionError(f"parallel sizes must be ≥ 1: {self}")
        return self.pp * math.lcm(self.tp, self.ep * self.expert_tp)

    def __str__(self) -> str:
        return f"TP{self.tp} PP{self.pp} EP{self.ep} ETP{self.expert_tp}"


@dataclass(frozen=True)
class ConvertJob:
    direction: str
    src: str
    out: str
    layout: ConvertLayout = ConvertLayout()
    dtype: str | None = None
    """hf-to-mcore: Megatron params dtype (default: the widest dtype in the HF files).
    mcore-to-hf: dtype of every written tensor (default: each tensor's dtype before conversion)."""
    hf_config: str | None = None
    """mcore-to-hf: the HF config (dir or config.json) when the checkpoint does not record one."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    progress: bool = True
    stats_file: str | None = None
    error_dir: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ConvertJob:
        data = json.loads(text)
        data["layout"] = ConvertLayout(**data["layout"])
        return cls(**data)


def parse_size(text: str) -> int:
    """'500MB', '2GB', '1.5GiB', '1048576' → bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 500MB, 5GB, 2GiB)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def check_job(job: ConvertJob, force: bool = False) -> None:
    """Cheap checks before any worker starts (bad paths, an existing output)."""
    if job.direction not in DIRECTIONS:
        raise ConversionError(f"unknown direction {job.direction!r}; expected one of {', '.join(DIRECTIONS)}")
    src, out = Path(job.src), Path(job.out)
    if not src.is_dir():
        raise ConversionError(f"{src}: no such directory")
    if job.direction == HF_TO_MCORE and not (src / "config.json").is_file():
        raise ConversionError(f"{src}: not a Hugging Face checkpoint (no config.json)")
    if job.direction == MCORE_TO_HF and not (src / COMPLETE).is_file():
        raise ConversionError(f"{src}: not a complete Megatron checkpoint (no {COMPLETE})")
    if out.resolve() == src.resolve():
        raise ConversionError("--out must differ from the source directory")
    if out.exists() and not force:
        raise ConversionError(f"{out} already exists (pass --force to replace it)")
    if job.max_shard_bytes <= 0:
        raise ConversionError("the maximum shard size must be positive")
    job.layout.world_size()


def write_error(job: ConvertJob, rank: int, text: str) -> None:
    """Called by a failing worker: the launcher prints the lowest rank's message."""
    if job.error_dir:
        Path(job.error_dir, f"rank{rank}.txt").write_text(text)


def stats_payload(stats: dict[str, Any]) -> str:
    return json.dumps(stats, indent=1, sort_keys=True)
