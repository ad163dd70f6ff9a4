"""`megatron-rl train`: the RL loop. One step: prompts → rollout → rewards/advantages → old/ref
log-probs → `steps_per_generation` updates → weight sync (+ verification) → metrics → checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ..config.loader import to_dict
from ..config.schema import RecipeConfig
from ..console import Progress
from ..objectives.chord import optimizer_step
from ..rollout.routes import attach_routes
from ..tasks import resolve_task
from .batch import build_batch, kl_penalty, score_groups, set_advantages
from .eval_phase import evaluate, load_eval_set
from .metrics_log import MetricsLog, console_line
from .report import startup_summary
from .rollout_phase import generate_groups
from .routing import routing_metrics
from .session import Session, Stop, timed
from .setup import export_hf, init_process_group, make_run_dir
from .step_parts import minibatches, probe_batch, sft_batch, step_metrics


def train(cfg: RecipeConfig, resume: bool = False) -> Path:
    task = resolve_task(cfg.task, cfg.rewards.weights)      # a bad plugin fails before any model
    init_process_group(cfg.trainer.collective_timeout_min)
    run_dir = make_run_dir(cfg, resume)
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    session = Session(cfg, run_dir, task)
    total, prompts_per_step = session.total_steps, session.prompts_per_step
    start = session.resume() if resume else 0
    log = open_metrics_log(cfg, run_dir, start)
    session.install_signal_handlers()
    seq_len = r.max_prompt_length + r.max_response_length
    pad = session.tokenizer.pad_token_id or 0
    probe = probe_batch(session, seq_len, pad, task.task.probe_response)
    objective = cfg.algorithm                    # what the objectives read, as the recipe wrote it
    eval_set = load_eval_set(cfg, session.tokenizer, task)
    try:
        session.start_server()
        session.sync()
        first = session.verify(probe)
        if session.rank0:
            print(startup_summary(cfg, session, task, start, first), flush=True)
        progress = Progress(start + 1, total)
        bad_in_row = 0
        for step in range(start + 1, total + 1):
            timings: dict[str, float] = {}
            indices = session.order.next_indices(prompts_per_step)
            with timed(timings, "rollout"):
                groups = _rollout(session, indices, step)
            with timed(timings, "reward"):
                task_metrics = score_groups(groups, task, _decoder(session))
                scored = build_batch(groups, seq_len, pad)
            batch = scored.batch
            with timed(timings, "logprobs"):
                temperature = session.sampling().logprobs_temperature
                batch.old_logprobs = session.actor.compute_logprobs(batch, temperature)
                if session.reference is not None:
                    batch.ref_logprobs = session.reference.compute_logprobs(batch, temperature)
                routing = routing_metrics(session.actor, batch, temperature, r.routing_replay_diagnostics)
            penalty = kl_penalty(batch, a.kl_beta, a.kl_estimator, a.kl_clamp) if a.kl_in_reward else None
            set_advantages(scored, a.advantage, a.mask_zero_variance_groups, penalty)
            updates = []
            with timed(timings, "train"):
                for i, mb in enumerate(minibatches(batch, a.steps_per_generation)):
                    if session.sft is not None:
                        mb.sft_tokens, mb.sft_mask = sft_batch(session, seq_len, pad)
                    # CHORD's μ counts optimizer steps (as ms-swift does), not rollout steps.
                    updates.append(session.actor.train_step(mb, objective, a.name, temperature,
                                                            rl_step=optimizer_step(step, a.steps_per_generation, i)))
            bad = all(u["update_skipped"] for u in updates)
            bad_in_row = bad_in_row + 1 if bad else 0
            if bad_in_row >= t.max_bad_steps_in_row:
                raise Stop(f"{bad_in_row} steps in a row had a non-finite loss or gradient; stopping")
            with timed(timings, "sync"):
                extra = session.sync()
                if r.verify_every and session.version % r.verify_every == 0:
                    extra.update(session.verify(probe))
            if eval_set is not None and step % cfg.evaluation.interval == 0:
                with timed(timings, "eval"):
                    extra.update(evaluate(session, eval_set, task))
            metrics = step_metrics(scored, batch, updates, timings, extra, session.version)
            metrics.update(task_metrics)
            metrics.update(routing)
            if penalty is not None:
                metrics["kl_in_reward/mean"] = float(penalty.mean())
            metrics.update({"data/epoch": session.order.epoch, "data/position": session.order.position})
            if log is not None:
                log.log(step, metrics)
            if session.rank0 and step % cfg.logging.log_interval == 0:
                print(console_line(progress.line(step), metrics), flush=True)
            session.agree_on_stop()
            interval = cfg.checkpoint.save_interval
            if (interval and step % interval == 0) or session.stop_signal or step == total:
                session.save(step)
            if session.stop_signal:
                print(f"[train] {session.stop_signal}: checkpointed step {step}; resume with --resume", flush=True)
                return run_dir
        if cfg.checkpoint.export_hf:
            export_hf(session.actor.model, session.adapter, session.hf_dir, run_dir / "hf_export")
        return run_dir
    finally:
        if log is not None:
            log.close()
        session.close()


def open_metrics_log(cfg: RecipeConfig, run_dir: Path, start: int) -> MetricsLog | None:
    """Rank 0 is the one writer of metrics.jsonl, TensorBoard and W&B (every rank has the same
    step metrics); W&B records the resolved recipe as the run's config."""
    if dist.get_rank() != 0:
        return None
    lg = cfg.logging
    return MetricsLog(run_dir, start, lg.tensorboard, lg.wandb_project, run_dir.name, to_dict(cfg))


def _rollout(session: Session, indices: list[int], step: int) -> list:
    box: list = [None]
    if session.rank0:
        assert session.client is not None, "rank 0 starts or attaches the servers before the first step"
        session.reseed_servers(step)
        p = session.prompts
        box[0] = generate_groups(session.client, [p.token_ids[i] for i in indices], [p.dicts[i] for i in indices],
                                 indices, session.sampling(), session.version)
        if session.cfg.rollout.routing_replay:
            attach_routes(session.servers, box[0])      # before the next sync: the same weights
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _decoder(session: Session):  # noqa: ANN202
    return lambda ids: session.tokenizer.decode(ids, skip_special_tokens=True)
