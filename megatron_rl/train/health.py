"""Run health: is the run still learning? A verdict per step from metrics the loop already has.

A run can collapse without a NaN: the tiny async GRPO without an importance correction went from
reward 0.38 to 0 in four steps (format rate 0, every group flat, gradient norm 0, every answer at
the length cap) and trained 75 dead steps to exit 0. Each signal below compares one step metric
with the run's own start (the mean of its first `trainer.health.baseline_steps` steps) or with an
absolute bound (the start of step s: the steps before it, up to that many, collapsed ones left
out), all thresholds in `HealthConfig`:

| signal | trips when |
|---|---|
| reward | `reward/mean` < start − reward_drop × abs(start) |
| format_rate | `format_rate` < (1 − format_drop) × start (tasks that report one) |
| flat_groups | `zero_variance_group_frac` ≥ flat_groups, reward not above its start |
| grad_norm | `grad_norm` < grad_norm_min, reward not above its start |
| entropy | `entropy` < entropy_low × start or > entropy_high × start |
| mismatch | `mismatch/abs_mean` > mismatch_max |
| length_at_cap | `response_length/mean` ≥ length_at_cap × `rollout.max_response_length` |

One signal alone is a warning (printed the first time each one trips); a step with `min_signals` of
them is collapsed, and `trainer.stop_when_collapsed` collapsed steps in a row stop the run after a
checkpoint, with one line naming the signals and the step the collapse began. Flat groups and a
zero gradient also describe a run that has learned everything, hence their reward condition.

Pure: every rank computes the same verdict from the same step metrics (`loop.learn` is
collective), so the stop needs no collective of its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.schema import HealthConfig, RecipeConfig

REWARD, FORMAT, FLAT, GRAD_NORM = "reward/mean", "format_rate", "zero_variance_group_frac", "grad_norm"
ENTROPY, MISMATCH, LENGTH = "entropy", "mismatch/abs_mean", "response_length/mean"
BASELINE_KEYS = (REWARD, FORMAT, ENTROPY)
"""The metrics measured against the run's own start."""
SIGNALS = ("reward", "format_rate", "flat_groups", "grad_norm", "entropy", "mismatch", "length_at_cap")
PREFIX = "health/"


def _value(metrics: Mapping[str, Any], key: str) -> float | None:
    v = metrics.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def baseline(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The start of each of `BASELINE_KEYS`: its mean over `rows` (finite values only)."""
    out: dict[str, float] = {}
    rows = list(rows)
    for key in BASELINE_KEYS:
        values = [v for v in (_value(r, key) for r in rows) if v is not None]
        if values:
            out[key] = sum(values) / len(values)
    return out


def signals(metrics: Mapping[str, Any], start: Mapping[str, float], h: HealthConfig,
            max_response_length: int) -> dict[str, str]:
    """Signal → reason, for every signal that trips on this step's `metrics`; `start` is the
    run's `baseline` (empty on its first step: only the absolute signals apply)."""
    v = {k: _value(metrics, k) for k in (REWARD, FORMAT, FLAT, GRAD_NORM, ENTROPY, MISMATCH, LENGTH)}
    reward, fmt, flat, grad, ent, mismatch, length = v.values()
    r0, f0, e0 = start.get(REWARD), start.get(FORMAT), start.get(ENTROPY)
    out: dict[str, str] = {}
    if reward is not None and r0 is not None and reward < r0 - h.reward_drop * abs(r0):
        out["reward"] = f"reward {reward:.3g} vs {r0:.3g} at the start"
    if fmt is not None and f0 is not None and fmt < (1 - h.format_drop) * f0:
        out["format_rate"] = f"format rate {fmt:.3g} vs {f0:.3g} at the start"
    not_better = reward is not None and r0 is not None and reward <= r0
    if not_better and flat is not None and flat >= h.flat_groups:
        out["flat_groups"] = f"{flat:.0%} of the groups flat (no advantage)"
    if not_better and grad is not None and grad < h.grad_norm_min:
        out["grad_norm"] = f"grad norm {grad:.2g} < {h.grad_norm_min:g}"
    if ent is not None and e0 is not None and e0 > 0 and not h.entropy_low * e0 <= ent <= h.entropy_high * e0:
        out["entropy"] = f"entropy {ent:.3g} vs {e0:.3g} at the start"
    if mismatch is not None and mismatch > h.mismatch_max:
        out["mismatch"] = f"train/rollout log-prob mismatch {mismatch:.3g} > {h.mismatch_max:g}"
    if length is not None and length >= h.length_at_cap * max_response_length:
        out["length_at_cap"] = f"mean response length {length:.3g} at the cap ({max_response_length})"
    return out


@dataclass
class RunHealth:
    """The verdict over the steps: the run's start, the collapsed steps in a row, what was warned."""

    health: HealthConfig
    stop_after: int
    """`trainer.stop_when_collapsed` (0 = never)."""
    max_response_length: int
    history: list[dict[str, Any]] = field(default_factory=list)
    """The first `baseline_steps` steps' metrics that were not collapsed: the start."""
    streak: int = 0
    streak_start: int | None = None
    warned: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, cfg: RecipeConfig, run_dir: Path, start: int) -> RunHealth:
        """A run's health at step `start`: a resumed run's start and streak come from the steps its
        metrics.jsonl holds up to there."""
        out = cls(cfg.trainer.health, cfg.trainer.stop_when_collapsed, cfg.rollout.max_response_length)
        for row in read_rows(run_dir / "metrics.jsonl", start):
            if not _value(row, PREFIX + "collapsed"):
                out._remember(int(row["step"]), row)
            out.streak = int(_value(row, PREFIX + "collapsed_steps") or 0)
            out.streak_start = int(row["step"]) - out.streak + 1 if out.streak else None
        return out

    @property
    def start(self) -> dict[str, float]:
        """The run's start as far as it is known: the steps before this one, up to `baseline_steps`
        (a collapse in the second step is one: the tiny GRPO at 20× its learning rate)."""
        return baseline(self.history)

    def _remember(self, step: int, metrics: Mapping[str, Any]) -> None:
        if len(self.history) < self.health.baseline_steps:
            self.history.append({"step": step, **{k: metrics.get(k) for k in BASELINE_KEYS}})

    def check(self, step: int, metrics: dict[str, Any], rank0: bool = True) -> str | None:
        """Adds this step's `health/*` to `metrics`, prints (`rank0`) a warning for each signal that
        trips for the first time, and returns the stop line once `stop_after` collapsed steps came
        in a row (else None)."""
        tripped = signals(metrics, self.start, self.health, self.max_response_length)
        collapsed = len(tripped) >= self.health.min_signals
        if not collapsed:       # a dead step is not the start the run is measured against
            self._remember(step, metrics)
        self.streak = self.streak + 1 if collapsed else 0
        self.streak_start = (self.streak_start or step) if collapsed else None
        metrics.update({PREFIX + "ok": float(not tripped), PREFIX + "signals": float(len(tripped)),
                        PREFIX + "collapsed": float(collapsed), PREFIX + "collapsed_steps": float(self.streak)})
        metrics.update({PREFIX + name: float(name in tripped) for name in SIGNALS})
        new = [name for name in tripped if name not in self.warned]
        self.warned.update(new)
        if new and rank0:
            print(f"[health] warning at step {step}: " + "; ".join(tripped[n] for n in new)
                  + f" ({len(tripped)} signal(s) this step; {self.health.min_signals} make a collapsed step)",
                  flush=True)
        if not (self.stop_after and self.streak >= self.stop_after):
            return None
        return (f"the run collapsed at step {self.streak_start}: {', '.join(tripped)} tripped on {self.streak} steps "
                f"in a row (trainer.stop_when_collapsed {self.stop_after}); at step {step}: "
                + "; ".join(tripped.values()))


def read_rows(path: Path, upto: int) -> list[dict[str, Any]]:
    """metrics.jsonl's rows of steps 1..`upto`, in order (none when the file is absent; a torn last
    line is skipped, as the metrics log repairs it)."""
    if upto <= 0 or not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= upto:
            rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


def verdict(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A finished run's health from its metrics rows (what the benches report): `collapsed` when any
    step was, the first such step, the most collapsed steps in a row, and the signals seen."""
    collapsed = [r for r in rows if _value(r, PREFIX + "collapsed")]
    seen = sorted({s for r in collapsed for s in SIGNALS if _value(r, PREFIX + s)})
    longest = max((int(_value(r, PREFIX + "collapsed_steps") or 0) for r in collapsed), default=0)
    return {"collapsed": bool(collapsed), "first_collapsed_step": collapsed[0]["step"] if collapsed else None,
            "collapsed_steps_in_a_row": longest, "signals": seen}
