"""What a run reports: each step's metrics (`step_metrics`, timed phases), written to
metrics.jsonl, TensorBoard and W&B when available, as a compact console line; and the start-up
summary `train` prints once (rank 0), after the first weight sync is verified."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.loader import to_dict
from ..config.schema import RecipeConfig
from ..console import summary
from ..schedule import RunSchedule
from ..tasks import LoadedTask
from ..types import TrainBatch
from .batch import ScoredRollout
from .fleet import RolloutFleet
from .health import SIGNALS as HEALTH_SIGNALS
from .policy import Policy

CONSOLE_KEYS = (("reward/mean", "reward"), ("accuracy", "acc"), ("format_rate", "fmt"),
                ("response_length/mean", "len"), ("kl", "kl"), ("clip_frac", "clip"),
                ("grad_norm", "gnorm"), ("mismatch/abs_mean", "mism"), ("eval/reward_mean", "eval_reward"),
                ("eval/accuracy", "eval_acc"), ("time/step", "s"))
ASYNC_CONSOLE_KEYS = (("rollout/staleness_mean", "stale"), ("time/trainer_wait_s", "wait"),
                      ("time/rollout_wait_s", "idle"))
"""Added with `rollout.max_staleness` > 0: how old the trained samples were, how long the trainer
waited for them and how long the servers had nothing to generate."""


# ------------------------------------------------------------------------------ one step
def step_metrics(scored: ScoredRollout, batch: TrainBatch, zero_variance_frac: float,
                 updates: list[dict[str, float]], timings: dict[str, float], extra: dict[str, float],
                 version: int) -> dict[str, float]:
    """`batch` is the trained one: policy log-probs, advantages, the mask after flat groups."""
    m: dict[str, float] = {"reward/mean": float(scored.rewards.mean()), "reward/std": float(scored.rewards.std()),
                           "response_length/mean": float(scored.response_lengths.mean()),
                           "zero_variance_group_frac": zero_variance_frac, "weight_version": version}
    for name, values in scored.reward_parts.items():
        m[f"reward/{name}/mean"] = float(values.mean())
        m[f"reward/{name}/std"] = float(values.std())
    assert batch.old_logprobs is not None and batch.rollout_logprobs is not None, \
        "a trained batch carries the old and the rollout log-probs"
    m["mismatch/abs_mean"] = _masked_mean_abs(batch.old_logprobs, batch.rollout_logprobs, batch.mask)
    last = updates[-1]
    for key, value in last.items():
        m[key if key in ("grad_norm", "lr", "update_skipped") else f"train/{key}"] = value
    m["update_skipped_count"] = float(sum(u["update_skipped"] for u in updates))
    m["kl"] = last.get("token/kl_mean", float("nan"))
    m["clip_frac"] = last.get("token/clip_low_frac", 0.0) + last.get("token/clip_high_frac", 0.0) \
        if "token/clip_low_frac" in last else last.get("seq/clip_low_frac", 0.0) + last.get("seq/clip_high_frac", 0.0)
    m["entropy"] = last.get("token/entropy_mean", float("nan"))
    m.update(timings)
    m.update(extra)
    m["time/step"] = sum(v for k, v in timings.items() if k.startswith("time/"))
    tokens = float(batch.mask.sum())
    m["tokens_per_s"] = tokens / max(m["time/step"], 1e-9)
    return m


def _masked_mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).sum() / mask.sum().clamp(min=1))


@contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Records the wall time of its block as `timings["time/<name>"]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[f"time/{name}"] = time.perf_counter() - start


# ------------------------------------------------------------------------------- the log
def open_metrics_log(cfg: RecipeConfig, run_dir: Path, start: int) -> MetricsLog | None:
    """Rank 0 is the one writer of metrics.jsonl, TensorBoard and W&B (every rank has the same
    step metrics); W&B records the resolved recipe as the run's config."""
    if dist.get_rank() != 0:
        return None
    lg = cfg.logging
    return MetricsLog(run_dir, start, lg.tensorboard, lg.wandb_project, run_dir.name, to_dict(cfg))


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


def console_line(progress: str, metrics: dict[str, float], asynchronous: bool = False) -> str:
    """One step: the progress bar (`console.Progress.line`), then the headline metrics."""
    parts = [progress]
    for key, short in CONSOLE_KEYS + (ASYNC_CONSOLE_KEYS if asynchronous else ()):
        if key in metrics and isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]):
            parts.append(f"{short} {metrics[key]:.3g}")
    tripped = [name for name in HEALTH_SIGNALS if metrics.get(f"health/{name}")]
    if tripped:         # `train/health.py`: which signals say the run may have stopped learning
        parts.append(f"health {'COLLAPSED' if metrics.get('health/collapsed') else 'warn'}: {', '.join(tripped)}")
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


# ---------------------------------------------------------------------------- start-up
def startup_summary(cfg: RecipeConfig, task: LoadedTask, policy: Policy, fleet: RolloutFleet,
                    schedule: RunSchedule, start: int, verified: dict[str, float]) -> str:
    p, r = cfg.parallelism, cfg.rollout
    world = dist.get_world_size()
    dp = p.data_parallel_size
    arch = (policy.hf.get("architectures") or ["?"])[0]
    dtype = str(policy.dtype).removeprefix("torch.")
    servers = ", ".join(s.base_url for s in fleet.servers) or "none"
    rewards = ", ".join(f"{name} ×{weight:g}" for name, weight in task.weights.items())
    total = schedule.rollout_steps
    steps = f"{start + 1}..{total}" if start else f"{total}"
    rows = [
        ("model", f"{arch}, {policy.hf.get('num_hidden_layers', '?')} layers, {dtype} ({policy.hf_dir})"),
        ("layout", f"{world} process(es): TP {p.tensor_model_parallel_size} · PP {p.pipeline_model_parallel_size}"
                   f" · EP {p.expert_model_parallel_size} · DP {dp}"),
        ("algorithm", f"{cfg.algorithm.name}, {cfg.algorithm.steps_per_generation} update(s) per rollout, "
                      f"correction {cfg.correction_summary}"),
        ("log-probs", r.logprobs_description()),
        ("task", f"{task.task.name}: {rewards}"),
        ("server", f"{servers} (weights verified: |Δ log-prob| mean {verified['sync/verify_mean_abs_diff']:.2g}, "
                   f"max {verified['sync/verify_max_abs_diff']:.2g})"),
        ("verify gate", f"noise floor mean {verified.get('sync/verify_floor_mean', float('nan')):.2g}, "
                        f"p90 {verified.get('sync/verify_floor_p90', float('nan')):.2g} → later syncs within mean "
                        f"{verified.get('sync/verify_bound_mean', float('nan')):.2g}, "
                        f"p90 {verified.get('sync/verify_bound_p90', float('nan')):.2g}"),
        ("steps", f"{steps} × {schedule.prompts_per_rollout} prompts × {r.n} samples"),
        ("run dir", str(fleet.run_dir)),
    ]
    return f"megatron-rl train\n{summary(rows)}"
