"""Routing-replay metrics of a training step (`rollout.routing_replay`)."""

from __future__ import annotations

from typing import Any

from ..types import TrainBatch


def routing_metrics(actor: Any, batch: TrainBatch, temperature: float, diagnostics: bool) -> dict[str, float]:
    """`routing/mismatch_frac` of the old-log-prob forward (the share of recorded (token, layer)
    rows whose trainer top-k differs from the rollout's: what replay overrides). With
    `diagnostics`: per layer, and the log-prob gap to the rollout without replay (one more forward;
    `mismatch/abs_mean` is the gap with replay). Every rank calls this (forwards are collective)."""
    if batch.routes is None:
        return {}
    out = {k: v for k, v in actor.routing_metrics.items() if diagnostics or "/layer_" not in k}
    if diagnostics and batch.rollout_logprobs is not None:
        plain = actor.compute_logprobs(batch, temperature, replay=False)
        gap = ((plain - batch.rollout_logprobs).abs() * batch.mask).sum() / batch.mask.sum().clamp(min=1)
        out["mismatch/abs_mean_no_replay"] = float(gap)
    return out
