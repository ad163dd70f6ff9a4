"""The published runs, counted as their stack counted them.

Article 000 ran ms-swift's transformers GRPO trainer (`RLHFArguments(rlhf_type='grpo', ...)`). Its
step counting is re-implemented here from ms-swift release/3.11 and TRL, and simulated micro-step
by micro-step, so that `recipes/qwen3_235b_a22b/gspo_qlora.yaml` can be checked against what that
run did rather than against what its argument names suggest:

- TRL `GRPOConfig.__post_init__`: with `steps_per_generation` set and `generation_batch_size`
  not, generation_batch_size = per_device_train_batch_size × processes × steps_per_generation.
- ms-swift `GRPOTrainer._prepare_inputs` (swift/trainers/rlhf_trainer/grpo_trainer.py): called
  once per micro-step (`self._step` counts forward/backward passes, gradient accumulation
  included); a new generation batch is generated when `_step % (steps_per_generation ×
  num_iterations) == 0`, and micro-step `_step` trains on slice `_step % steps_per_generation`.
- `old_policy()`: `num_iterations > 1 or gradient_accumulation_steps % steps_per_generation != 0`;
  when False, π_old = the training forward's own log-probs, detached (ratio 1).
- transformers: `max_steps` counts optimizer steps; warm-up = ⌈warmup_ratio × max_steps⌉.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.config.rules import lint
from megatron_rl.schedule import run_schedule

REPO = Path(__file__).resolve().parents[2]
QLORA = REPO / "recipes/qwen3_235b_a22b/gspo_qlora.yaml"


@dataclass
class MsSwiftRun:
    optimizer_steps: int
    prompts: int
    completions: int
    completions_per_optimizer_step: int
    generations_per_optimizer_step: int
    max_staleness: int
    """Optimizer steps between a generation's weights and the weights its samples update."""
    uses_per_generation: int
    """Optimizer steps that train on one generation's samples."""
    old_policy: bool
    warmup_steps: int


def ms_swift_transformers_grpo(*, per_device_train_batch_size: int, gradient_accumulation_steps: int,
                               num_processes: int, num_generations: int, steps_per_generation: int,
                               max_steps: int, warmup_ratio: float, num_iterations: int = 1) -> MsSwiftRun:
    generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation
    assert generation_batch_size % num_generations == 0
    prompts_per_generation = generation_batch_size // num_generations
    version = 0                       # optimizer steps taken so far = the weights' version
    step = 0                          # ms-swift's self._step
    generations: list[int] = []       # the version each generation was sampled with
    buffered = None
    used_by: dict[int, set[int]] = {}
    staleness, completions_per_step = [], []
    for _ in range(max_steps):
        completions = 0
        for _ in range(gradient_accumulation_steps):
            generate_every = steps_per_generation * num_iterations
            if step % generate_every == 0 or buffered is None:
                generations.append(version)
                buffered = len(generations) - 1
            # inputs = buffered[step % steps_per_generation]: one per-device slice of the generation
            completions += per_device_train_batch_size * num_processes
            staleness.append(version - generations[buffered])
            used_by.setdefault(buffered, set()).add(version)
            step += 1
        completions_per_step.append(completions)
        version += 1
    old_policy = num_iterations > 1 or gradient_accumulation_steps % steps_per_generation != 0
    return MsSwiftRun(
        optimizer_steps=version, prompts=len(generations) * prompts_per_generation,
        completions=len(generations) * generation_batch_size,
        completions_per_optimizer_step=completions_per_step[0],
        generations_per_optimizer_step=len(generations) // version,
        max_staleness=max(staleness), uses_per_generation=max(len(v) for v in used_by.values()),
        old_policy=old_policy, warmup_steps=math.ceil(warmup_ratio * max_steps))


# Article 000's RLHFArguments (one process over 8 GPUs, device_map model parallelism).
ARTICLE_000 = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, num_processes=1,
                   num_generations=2, steps_per_generation=2, max_steps=50, warmup_ratio=0.05)


def test_ms_swift_counted_article_000_as_50_on_policy_updates_over_100_prompts() -> None:
    run = ms_swift_transformers_grpo(**ARTICLE_000)
    assert (run.optimizer_steps, run.prompts, run.completions) == (50, 100, 200)
    assert (run.completions_per_optimizer_step, run.generations_per_optimizer_step) == (4, 2)
    # Both generations of an optimizer step come from the weights that step updates, and each
    # generation feeds one optimizer step: strictly on-policy, π_old = π_θ (ratio 1).
    assert (run.max_staleness, run.uses_per_generation, run.old_policy) == (0, 1, False)
    assert run.warmup_steps == 3
    # What the project's old reading (steps_per_generation = optimizer steps per rollout) would be
    # in ms-swift's terms: gradient accumulation 2 per generation of 2 micro-steps and 4 samples
    # per update — off-policy, with the clip acting.
    off = ms_swift_transformers_grpo(**{**ARTICLE_000, "gradient_accumulation_steps": 1})
    assert off.max_staleness == 1 and off.old_policy


def test_the_qlora_recipe_counts_what_ms_swift_counted() -> None:
    cfg = load_recipe(QLORA)
    ours = run_schedule(cfg)
    theirs = ms_swift_transformers_grpo(**ARTICLE_000)
    assert ours is not None
    assert ours.updates == theirs.optimizer_steps == 50
    assert ours.prompts_sampled == theirs.prompts == 100
    assert ours.completions_per_update == theirs.completions_per_optimizer_step == 4
    assert ours.updates * ours.completions_per_update == theirs.completions == 200
    assert ours.on_policy and not theirs.old_policy and theirs.max_staleness == 0
    assert ours.updates_per_rollout == theirs.uses_per_generation == 1
    assert ours.warmup_updates == theirs.warmup_steps == 3          # not int(0.05 × 50) = 2
    assert cfg.rollout.n == ARTICLE_000["num_generations"]


def test_the_qlora_recipe_carries_ms_swift_s_defaults_where_the_script_is_silent() -> None:
    cfg = load_recipe(QLORA)
    assert cfg.trainer.adam_beta2 == 0.95                   # TrainArgumentsMixin.adam_beta2
    assert cfg.lora.dropout == 0.05                         # TunerArguments.lora_dropout
    assert (cfg.algorithm.advantage_std, cfg.algorithm.advantage_eps) == ("unbiased", 1e-4)
    assert cfg.rollout.max_prompt_length == 2500            # max_length = the prompt cap in GRPO
    assert cfg.evaluation.interval == 0 and cfg.data.eval_path is None   # eval_strategy 'no'
    assert cfg.trainer.seed == 42 and cfg.checkpoint.save_interval == 1


def test_lint_warns_not_errs_for_on_policy_gspo_and_names_the_article() -> None:
    findings = [f for f in lint(load_recipe(QLORA), check_paths=False) if f.rule == "gspo-never-clips"]
    assert [f.level for f in findings] == ["warning"]
    assert "article 000" in findings[0].message and "on-policy" in findings[0].message


def test_recipe_show_prints_the_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", "show", str(QLORA)]) == 0
    out = capsys.readouterr().out
    assert "  steps_per_generation: 1\n" in out and "  adam_beta2: 0.95\n" in out
    assert "  dropout: 0.05\n" in out and "evaluation:\n  interval: 0\n" in out
    assert "# 50 rollout steps × 1 optimizer update(s) = 50 optimizer steps (on-policy: policy ratio 1)" in out
    assert "100 prompts sampled over the run" in out and "# LR: 3 warm-up step(s), schedule over 50" in out
