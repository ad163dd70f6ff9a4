"""Per-step metrics: a compact console line, metrics.jsonl, TensorBoard and W&B when available."""

from __future__ import annotations

import json
import math
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
        """On resume, drop lines of steps that will be run again (they were not checkpointed)."""
        if not self.path.is_file():
            return
        keep = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")

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
