"""The trainer's side of one step: the policy's (and the reference's) log-probs of the rollout
batch, then `steps_per_generation` optimizer updates on consecutive minibatches."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config.schema import AlgorithmConfig
from ..objectives.chord import optimizer_step
from ..types import TrainBatch
from .routing import routing_metrics
from .step_parts import minibatches, sft_batch


def with_policy_logprobs(session: Any, batch: TrainBatch, temperature: float) -> tuple[TrainBatch, dict[str, float]]:
    """`batch` with the actor's log-probs before any update (π_old) and, when the run has a
    reference model, the reference's; and the routing metrics of the π_old forward when the batch
    carries the rollout's MoE routes (collective)."""
    old = session.actor.compute_logprobs(batch, temperature)
    routing = routing_metrics(session.actor, batch, temperature, session.cfg.rollout.routing_replay_diagnostics)
    ref = session.reference.compute_logprobs(batch, temperature) if session.reference is not None else None
    return replace(batch, old_logprobs=old, ref_logprobs=ref), routing


def update(session: Any, batch: TrainBatch, objective: AlgorithmConfig, step: int, temperature: float,
           seq_len: int, pad: int) -> list[dict[str, float]]:
    """One optimizer step per minibatch (CHORD adds the next expert rows to each); returns each
    step's metrics (collective)."""
    a = objective
    updates = []
    for i, mb in enumerate(minibatches(batch, a.steps_per_generation)):
        if session.sft is not None:
            sft_tokens, sft_mask = sft_batch(session, seq_len, pad)
            mb = replace(mb, sft_tokens=sft_tokens, sft_mask=sft_mask)
        # CHORD's μ counts optimizer steps (as ms-swift does), not rollout steps.
        updates.append(session.actor.train_step(mb, objective, a.name, temperature,
                                                rl_step=optimizer_step(step, a.steps_per_generation, i)))
    return updates
