"""Whether a run may use its run dir, decided from the files alone (no torch: `megatron-rl train`
asks before it imports the trainer, `RunDir.make` again on every rank)."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..config import resume
from ..config.schema import RecipeConfig

RUN_DIR_ENTRIES = {"recipe.resolved.yaml", "recipe.resolved.yaml.tmp", "rollout", "checkpoints", "tensorboard",
                   "metrics.jsonl", "metrics.jsonl.tmp"}
"""What a run writes into its run dir before (and at) its first step."""


def never_started(run: Path) -> bool:
    """A run dir of a run that failed before its first step: only what a run writes, no metrics,
    no checkpoint. Nothing in it is worth keeping, so it neither blocks a fresh run under the same
    name nor survives the failure. A directory holding anything else is never taken for one."""
    names = {p.name for p in run.iterdir()} if run.is_dir() else set()
    metrics = run / "metrics.jsonl"
    logged = metrics.is_file() and metrics.stat().st_size > 0
    return "recipe.resolved.yaml" in names and names <= RUN_DIR_ENTRIES and not logged \
        and not any((run / "checkpoints").glob("step_*"))


def refusal(cfg: RecipeConfig, run: Path, resume_it: bool) -> str | None:
    """Why the run cannot use `run` (None = it can): a fresh run never overwrites a started one, a
    resume continues only a run of the same experiment (`config/resume.py`)."""
    if not (run.exists() and any(run.iterdir()) and not never_started(run)):
        return None
    if not resume_it:
        return f"run dir {run} exists; pass --resume to continue it or pick another logging.run_name"
    saved = run / "recipe.resolved.yaml"
    if not saved.is_file():
        return None
    differing = resume.experiment_differences(yaml.safe_load(saved.read_text(encoding="utf-8")) or {}, cfg)
    return resume.refusal(str(run), differing) if differing else None
