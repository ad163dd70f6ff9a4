"""`megatron-rl train`: the RL loop. One step: prompts → rollout → rewards/advantages → old/ref
log-probs → `steps_per_generation` updates → weight sync (+ verification) → metrics → checkpoint.
With `rollout.max_staleness` > 0 the rollout of the next steps runs meanwhile (`ahead.py`).

Each step is two verbs on the run's objects: `learn` (the servers' rollout → the batch → the
policy's updates) and `publish` (the updated weights to the servers, verified, and the periodic
evaluation). `RolloutFleet` owns the servers, `WeightPublisher` the weights they hold (the
version, the transports, the gate), `Policy` the actor and reference, `TrainData` the prompts and
their order, `RunDir` the files and the checkpoints.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config.schema import RecipeConfig
from ..console import Progress
from ..schedule import run_schedule
from ..tasks import LoadedTask, resolve_task
from ..types import TrainBatch
from .ahead import Rollouts, make_rollouts
from .batch import ScoredRollout, build_batch, kl_penalty, probe, score_groups, with_advantages
from .data import Prompts, TrainData, load_eval_set
from .fleet import RolloutFleet
from .health import RunHealth
from .metrics import console_line, open_metrics_log, startup_summary, step_metrics, timed
from .policy import Policy, starting_checkpoint
from .publisher import WeightPublisher, overlaps_verification
from .run import RunDir, Stop, StopSignals, agree_on_stop, init_process_group


def train(cfg: RecipeConfig, resume: bool = False) -> Path:
    task = resolve_task(cfg.task, cfg.rewards.weights)      # a bad plugin fails before any model
    init_process_group(cfg.trainer.collective_timeout_min)
    run = RunDir.make(cfg, resume)
    init = starting_checkpoint(cfg)
    data = TrainData.load(cfg, task, cfg.model.tokenizer or init.hf_dir)
    schedule = run_schedule(cfg, len(data.prompts.records))
    assert schedule is not None
    policy = Policy(cfg, init, schedule.updates)
    fleet = RolloutFleet(cfg, run.path, init)
    publisher = WeightPublisher(cfg, fleet)
    total = schedule.rollout_steps
    resumed = run.resume(policy.actor, init) if resume else None
    if resumed is not None:
        data.load_state(resumed.extra)
    start = resumed.step if resumed else 0
    log = open_metrics_log(cfg, run.path, start)
    health = RunHealth.of(cfg, run.path, start)
    signals = StopSignals().install()
    seq_len = cfg.rollout.max_prompt_length + cfg.rollout.max_response_length
    forced = probe(data.tokenizer, data.prompts.token_ids, seq_len, data.pad_id, task.task.probe_response)
    eval_set = load_eval_set(cfg, data.tokenizer, task)
    rollouts = make_rollouts(fleet, data, schedule.prompts_per_rollout, total, cfg.rollout.max_staleness)
    try:
        fleet.start()
        publisher.open()
        first = publisher.start(policy, forced, seq_len, data.pad_id, resumed.version if resumed else None)
        if fleet.rank0:
            print(startup_summary(cfg, task, policy, fleet, schedule, start, first), flush=True)
        progress = Progress(start + 1, total)
        bad_in_row = 0
        overlap = overlaps_verification(cfg, policy.dtype)
        rollouts.start(start + 1, publisher.version)
        last_logged = time.perf_counter()
        for step in range(start + 1, total + 1):
            learned = learn(cfg, task, data, policy, rollouts, step, publisher.version,
                            check=publisher.check if overlap else None)
            bad_in_row = bad_in_row + 1 if all(u["update_skipped"] for u in learned.updates) else 0
            if bad_in_row >= cfg.trainer.max_bad_steps_in_row:
                raise Stop(f"{bad_in_row} steps in a row had a non-finite loss or gradient; stopping")
            with rollouts.servers():
                # The last sync, and one an evaluation generates on, is verified before the step ends.
                published = publish(cfg, task, data, policy, publisher, step, eval_set,
                                    overlap and step < total and not _evaluates(cfg, eval_set, step))
            version = publisher.version
            rollouts.published(version)
            metrics = learned.metrics(published, version)
            metrics.update({"data/epoch": learned.order["epoch"], "data/position": learned.order["position"]})
            # Wall time since the last step's metrics: its phases plus the loop's own (logging,
            # health, checkpoint), which `time/step` leaves out.
            now = time.perf_counter()
            metrics["time/iteration_s"], last_logged = now - last_logged, now
            collapsed = health.check(step, metrics, fleet.rank0)     # + health/*; the stop line of a dead run
            if log is not None:
                log.log(step, metrics)
            if fleet.rank0 and step % cfg.logging.log_interval == 0:
                print(console_line(progress.line(step), metrics, cfg.rollout.max_staleness > 0), flush=True)
            stop = agree_on_stop(signals.reason or collapsed)
            interval = cfg.checkpoint.save_interval
            if (interval and step % interval == 0) or stop or step == total:
                run.save(policy.actor, init, step, version, rollouts.state())
            if collapsed:       # exit status 1: a Slurm job is not requeued into more dead steps
                raise Stop(f"{collapsed}; checkpointed step {step}")
            if stop:
                print(f"[train] {stop}: checkpointed step {step}; resume with --resume", flush=True)
                return run.path
        if cfg.checkpoint.export_hf:
            run.export_hf(policy.actor.model, policy.adapter, init.hf_dir)
        return run.path
    finally:
        rollouts.close()
        if log is not None:
            log.close()
        fleet.close(publisher.close)


@dataclass(frozen=True)
class Published:
    """What publishing one step's weights measured: sync, verification and eval metrics."""

    metrics: dict[str, float]
    timings: dict[str, float]
    """`time/sync` and, on eval steps, `time/eval`."""


@dataclass(frozen=True)
class Learned:
    """What one step's rollout taught the actor."""

    scored: ScoredRollout
    batch: TrainBatch
    """The trained batch: policy log-probs, advantages, the mask after flat groups."""
    zero_variance_frac: float
    kl_penalty: torch.Tensor | None
    updates: list[dict[str, float]]
    task_metrics: dict[str, float]
    routing_metrics: dict[str, float]
    """`routing/*` of the π_old forward (`rollout.routing_replay`), else empty."""
    timings: dict[str, float]
    """`time/rollout` (the trainer's wait for the step's groups), `time/reward`, `time/logprobs`,
    `time/train`."""
    rollout_metrics: dict[str, float]
    """`rollout/staleness_*`, `rollout/dropped_stale` and the two waits (`train/ahead.py`)."""
    order: dict[str, Any]
    """The prompt order after this step's draw."""

    def metrics(self, published: Published, version: int) -> dict[str, float]:
        timings = {**self.timings, **published.timings}
        m = step_metrics(self.scored, self.batch, self.zero_variance_frac, self.updates, timings, published.metrics,
                         version)
        m.update(self.task_metrics)
        m.update(self.routing_metrics)
        # The two waits are not phases of the step: added after `time/step` is summed. Without a
        # producer (max_staleness 0) the servers are idle for all of the step but its generation.
        waits = dict(self.rollout_metrics)
        waits.setdefault("time/rollout_wait_s", m["time/step"] - waits["time/trainer_wait_s"])
        m.update(waits)
        if self.kl_penalty is not None:
            m["kl_in_reward/mean"] = float(self.kl_penalty.mean())
        return m


def learn(cfg: RecipeConfig, task: LoadedTask, data: TrainData, policy: Policy, rollouts: Rollouts,
          step: int, version: int, check: Callable[[Policy], dict[str, float]] | None = None) -> Learned:
    """The step's rollout (generated now on the servers' weights `version`, or ahead of time on a
    version at most `rollout.max_staleness` older) → rewards → old/ref log-probs → advantages →
    `steps_per_generation` updates of policy `version` (collective; every rank returns the same).
    `check` (`WeightPublisher.check`) judges the verification of the weights the rollout was
    generated on when the last sync only started it: it raises `Stop` before any update."""
    a, r = cfg.algorithm, cfg.rollout
    timings: dict[str, float] = {}
    with timed(timings, "rollout"):
        rollout = rollouts.take(step, version)
    with timed(timings, "verify_wait"):
        verified = check(policy) if check is not None else {}
    groups = rollout.groups
    with timed(timings, "reward"):
        scores = score_groups(groups, task, data.decode)
        scored = build_batch(groups, scores, r.max_prompt_length + r.max_response_length, data.pad_id)
    with timed(timings, "logprobs"):
        batch, routing = policy.logprobs(scored.batch)
    penalty = kl_penalty(batch, a.kl_beta, a.kl_estimator, a.kl_clamp) if a.kl_in_reward else None
    batch, zero_variance_frac = with_advantages(scored, batch, a.advantage, a.mask_zero_variance_groups, penalty,
                                                unbiased_std=a.advantage_std == "unbiased", eps=a.advantage_eps)
    with timed(timings, "train"):
        updates = policy.update(batch, step, data.sft)
    batch = policy.with_old_from_update(batch)
    return Learned(scored, batch, zero_variance_frac, penalty, updates, {**verified, **scores.task_metrics}, routing,
                   timings, rollout.metrics, rollout.order)


def publish(cfg: RecipeConfig, task: LoadedTask, data: TrainData, policy: Policy, publisher: WeightPublisher,
            step: int, eval_set: Prompts | None, overlap: bool = False) -> Published:
    """Sync the updated weights as the next version, verify them every `rollout.verify_every`
    versions (with `overlap`: start the verification, which the next step's `learn` judges
    before it trains), evaluate every `evaluation.interval` steps; returns their metrics and
    timings (collective)."""
    timings: dict[str, float] = {}
    with timed(timings, "sync"):
        extra = publisher.publish(policy, overlap)
    if eval_set is not None and _evaluates(cfg, eval_set, step):
        with timed(timings, "eval"):
            extra.update(publisher.fleet.evaluate(eval_set, task, publisher.version, data.decode))
    return Published(extra, timings)


def _evaluates(cfg: RecipeConfig, eval_set: Prompts | None, step: int) -> bool:
    return eval_set is not None and step % cfg.evaluation.interval == 0
