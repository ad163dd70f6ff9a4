"""`megatron-rl train`: the RL loop. One step: prompts → rollout → rewards/advantages → old/ref
log-probs → `steps_per_generation` updates → weight sync (+ verification) → metrics → checkpoint.

Each phase is a function from what it needs to what it produces (groups → scores → batch →
updates → sync report → metrics); `Session` only holds the objects they use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..config.loader import to_dict
from ..config.schema import RecipeConfig
from ..console import Progress
from ..sync.verify import Gate
from ..tasks import LoadedTask, resolve_task
from ..types import TrainBatch
from . import sync_phase
from .batch import ScoredRollout, build_batch, kl_penalty, score_groups, with_advantages
from .checkpointing import resume as resume_checkpoint
from .checkpointing import save
from .eval_phase import evaluate, load_eval_set
from .metrics_log import MetricsLog, console_line
from .report import startup_summary
from .rollout_phase import rollout
from .run_control import Stop, StopSignals, agree_on_stop
from .session import Session
from .setup import Prompts, export_hf, init_process_group, make_run_dir
from .step_parts import probe_batch, step_metrics, timed
from .update_phase import update, with_policy_logprobs


def train(cfg: RecipeConfig, resume: bool = False) -> Path:
    task = resolve_task(cfg.task, cfg.rewards.weights)      # a bad plugin fails before any model
    init_process_group(cfg.trainer.collective_timeout_min)
    run_dir = make_run_dir(cfg, resume)
    session = Session(cfg, run_dir, task)
    total = session.total_steps
    resumed = resume_checkpoint(session) if resume else None
    start, version = (resumed.step, resumed.version) if resumed else (0, 0)
    log = open_metrics_log(cfg, run_dir, start)
    signals = StopSignals().install()
    r = cfg.rollout
    seq_len = r.max_prompt_length + r.max_response_length
    forced = probe_batch(session, seq_len, _pad(session), task.task.probe_response)
    eval_set = load_eval_set(cfg, session.tokenizer, task)
    try:
        session.start_server()
        # A resumed run re-sends its checkpointed weights under their own version.
        version = version if resumed else version + 1
        if sync_phase.calibrates_before_push(session, resumed is not None):
            # The noise floor on the servers' own load of the checkpoint; the first sync is gated.
            probe, gate, first = sync_phase.calibrate(session, forced, 0, seq_len, _pad(session))
            sync_phase.push_weights(session, version)
            first.update(sync_phase.verify(session, probe, version, gate))
        else:
            sync_phase.push_weights(session, version)
            probe, gate, first = sync_phase.calibrate(session, forced, version, seq_len, _pad(session))
        if session.rank0:
            print(startup_summary(cfg, session, task, start, first), flush=True)
        progress = Progress(start + 1, total)
        bad_in_row = 0
        for step in range(start + 1, total + 1):
            timings: dict[str, float] = {}
            learned = learn(session, task, step, version, timings)
            bad_in_row = bad_in_row + 1 if all(u["update_skipped"] for u in learned.updates) else 0
            if bad_in_row >= cfg.trainer.max_bad_steps_in_row:
                raise Stop(f"{bad_in_row} steps in a row had a non-finite loss or gradient; stopping")
            version += 1
            published = publish(session, task, step, version, (probe, gate), eval_set, timings)
            metrics = learned.metrics(timings, published, version)
            metrics.update({"data/epoch": session.order.epoch, "data/position": session.order.position})
            if log is not None:
                log.log(step, metrics)
            if session.rank0 and step % cfg.logging.log_interval == 0:
                print(console_line(progress.line(step), metrics), flush=True)
            stop = agree_on_stop(signals.reason)
            interval = cfg.checkpoint.save_interval
            if (interval and step % interval == 0) or stop or step == total:
                save(session, step, version)
            if stop:
                print(f"[train] {stop}: checkpointed step {step}; resume with --resume", flush=True)
                return run_dir
        if cfg.checkpoint.export_hf:
            export_hf(session.actor.model, session.adapter, session.hf_dir, run_dir / "hf_export")
        return run_dir
    finally:
        if log is not None:
            log.close()
        session.close()


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

    def metrics(self, timings: dict[str, float], extra: dict[str, float], version: int) -> dict[str, float]:
        m = step_metrics(self.scored, self.batch, self.zero_variance_frac, self.updates, timings, extra, version)
        m.update(self.task_metrics)
        m.update(self.routing_metrics)
        if self.kl_penalty is not None:
            m["kl_in_reward/mean"] = float(self.kl_penalty.mean())
        return m


def learn(session: Session, task: LoadedTask, step: int, version: int, timings: dict[str, float]) -> Learned:
    """Rollout with the servers' weights (`version`) → rewards → old/ref log-probs → advantages →
    `steps_per_generation` updates (collective; every rank returns the same)."""
    a, r = session.cfg.algorithm, session.cfg.rollout
    seq_len, pad = r.max_prompt_length + r.max_response_length, _pad(session)
    indices = session.order.next_indices(session.prompts_per_step)
    with timed(timings, "rollout"):
        groups = rollout(session, indices, step, version)
        session.sleep_servers()
    with timed(timings, "reward"):
        scores = score_groups(groups, task, _decoder(session))
        scored = build_batch(groups, scores, seq_len, pad)
    temperature = session.sampling().logprobs_temperature
    with timed(timings, "logprobs"):
        batch, routing = with_policy_logprobs(session, scored.batch, temperature)
    penalty = kl_penalty(batch, a.kl_beta, a.kl_estimator, a.kl_clamp) if a.kl_in_reward else None
    batch, zero_variance_frac = with_advantages(scored, batch, a.advantage, a.mask_zero_variance_groups, penalty,
                                                unbiased_std=a.advantage_std == "unbiased", eps=a.advantage_eps)
    with timed(timings, "train"):
        updates = update(session, batch, a, step, temperature, seq_len, pad)
    return Learned(scored, batch, zero_variance_frac, penalty, updates, scores.task_metrics, routing)


def publish(session: Session, task: LoadedTask, step: int, version: int, probe: tuple[TrainBatch, Gate],
            eval_set: Prompts | None, timings: dict[str, float]) -> dict[str, float]:
    """Sync the updated weights as `version`, verify them every `rollout.verify_every` versions,
    evaluate every `evaluation.interval` steps; returns their metrics (collective)."""
    cfg = session.cfg
    with timed(timings, "sync"):
        session.wake_servers()
        extra = sync_phase.sync_metrics(sync_phase.push_weights(session, version))
        if cfg.rollout.verify_every and version % cfg.rollout.verify_every == 0:
            batch, gate = probe
            extra.update(sync_phase.verify(session, batch, version, gate))
    if eval_set is not None and step % cfg.evaluation.interval == 0:
        with timed(timings, "eval"):
            extra.update(evaluate(session, eval_set, task, version))
    return extra


def open_metrics_log(cfg: RecipeConfig, run_dir: Path, start: int) -> MetricsLog | None:
    """Rank 0 is the one writer of metrics.jsonl, TensorBoard and W&B (every rank has the same
    step metrics); W&B records the resolved recipe as the run's config."""
    if dist.get_rank() != 0:
        return None
    lg = cfg.logging
    return MetricsLog(run_dir, start, lg.tensorboard, lg.wandb_project, run_dir.name, to_dict(cfg))


def _pad(session: Session) -> int:
    return session.tokenizer.pad_token_id or 0


def _decoder(session: Session):  # noqa: ANN202
    return lambda ids: session.tokenizer.decode(ids, skip_special_tokens=True)
