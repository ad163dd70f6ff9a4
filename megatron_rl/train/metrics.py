"""Per-step metrics: a compact console line, metrics.jsonl, TensorBoard and W&B when available."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

CONSOLE_KEYS = (("reward/mean", "reward"), ("accuracy", "acc"), ("format_rate", "fmt"),
                ("response_length/mean", "len"), ("kl", "kl"), ("clip_frac", "clip"),
                ("grad_norm", "gnorm"), ("mismatch/abs_mean", "mism"), ("eval/reward_mean", "eval_reward"),
                ("eval/accuracy", "eval_acc"), ("time/step", "s"))


class MetricsLog:
    def __init__(self, run_dir: Path, resume_step: int, tensorboard: bool, wandb_project: str | None,
                 run_name: str, config: dict[str, Any]) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._truncate_after(resume_step)
        self.file = open(self.path, "a", encoding="utf-8")
        self.tb = _tensorboard(run_dir) if tensorboard else None
        self.wandb = _wandb(wandb_project, run_name, config) if wandb_project else None

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps that will be run again (they were not checkpointed), and
        a torn last line: what a kill or a full disk leaves in the middle of an append. The file is
        replaced atomically, so a crash here leaves the old one."""
        if not self.path.is_file():
            return
        lines = self.path.read_bytes().decode("utf-8", errors="replace").splitlines()
        keep = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                if number < len(lines):
                    raise ValueError(f"{self.path}:{number}: not a JSON line ({exc.msg}); only a torn last "
                                     "line is repaired on resume") from exc
                print(f"[metrics] {self.path}: dropped a torn last line ({len(line)} chars, line {number}) "
                      "left by an interrupted write", flush=True)
                continue
            if record["step"] <= step:
                keep.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def console_line(progress: str, metrics: dict[str, float]) -> str:
    """One step: the progress bar (`console.Progress.line`), then the headline metrics."""
    parts = [progress]
    for key, short in CONSOLE_KEYS:
        if key in metrics and isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]):
            parts.append(f"{short} {metrics[key]:.3g}")
    return " | ".join(parts)


def _clean(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _tensorboard(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("[metrics] tensorboard is not installed; TensorBoard logging is off", flush=True)
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def _wandb(project: str, name: str, config: dict[str, Any]) -> Any:
    try:
        import wandb
    except ImportError:
        print("[metrics] wandb is not installed; W&B logging is off", flush=True)
        return None
    return wandb.init(project=project, name=name, config=config)
