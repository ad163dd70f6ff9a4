"""How many rollouts, optimizer steps and prompts a recipe runs: the one place that counts them.

A rollout step samples `prompts_per_rollout` prompts × `rollout.n` completions and makes
`algorithm.steps_per_generation` optimizer steps on consecutive minibatches of
`trainer.global_batch_size` completions. `trainer.max_steps` counts rollout steps; without it the
run makes `epochs` passes over the prompts. The LR schedule spans the optimizer steps, and its
warm-up is ⌈lr_warmup_ratio × optimizer steps⌉, as transformers rounds it
(`TrainingArguments.get_warmup_steps`).

At `steps_per_generation` 1 every update trains on completions of the weights being updated: the
run is on-policy and the policy ratio is exactly 1 (`Actor.train_step` takes π_old from the
training forward itself, as ms-swift's transformers trainer does when gradient accumulation is a
multiple of its micro-step `steps_per_generation`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config.schema import RecipeConfig


def warmup_updates(ratio: float, updates: int) -> int:
    """Linear-warm-up optimizer steps: transformers' ⌈ratio × steps⌉ (0 when the ratio is 0)."""
    return math.ceil(ratio * updates) if ratio > 0 else 0


@dataclass(frozen=True)
class RunSchedule:
    prompts_per_rollout: int
    completions_per_prompt: int
    completions_per_update: int
    updates_per_rollout: int
    rollout_steps: int
    updates: int
    """Optimizer steps of the whole run: the LR schedule's length."""
    warmup_updates: int
    prompts_sampled: int
    """Prompts drawn over the run (with repeats once it passes the end of an epoch)."""
    on_policy: bool

    def lines(self) -> list[str]:
        policy = "on-policy: policy ratio 1" if self.on_policy else \
            f"updates 2..{self.updates_per_rollout} of each rollout are off-policy"
        return [
            f"{self.rollout_steps} rollout steps × {self.updates_per_rollout} optimizer update(s) = "
            f"{self.updates} optimizer steps ({policy})",
            f"{self.prompts_per_rollout} prompts × {self.completions_per_prompt} completions per rollout, "
            f"{self.completions_per_update} completions per optimizer step; {self.prompts_sampled} prompts "
            "sampled over the run",
            f"LR: {self.warmup_updates} warm-up step(s), schedule over {self.updates} optimizer steps",
        ]


def run_schedule(cfg: RecipeConfig, num_prompts: int | None = None) -> RunSchedule | None:
    """The run's counts; None when they depend on the prompt file (no `max_steps`) and
    `num_prompts` is not given."""
    t, a = cfg.trainer, cfg.algorithm
    per_rollout = t.global_batch_size * a.steps_per_generation // cfg.rollout.n
    if t.max_steps is not None:
        steps = t.max_steps
    elif num_prompts is not None:
        steps = t.epochs * math.ceil(num_prompts / max(per_rollout, 1))
    else:
        return None
    updates = steps * a.steps_per_generation
    return RunSchedule(prompts_per_rollout=per_rollout, completions_per_prompt=cfg.rollout.n,
                       completions_per_update=t.global_batch_size,
                       updates_per_rollout=a.steps_per_generation, rollout_steps=steps, updates=updates,
                       warmup_updates=warmup_updates(t.lr_warmup_ratio, updates),
                       prompts_sampled=steps * per_rollout, on_policy=a.steps_per_generation == 1)
