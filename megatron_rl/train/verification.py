"""Statistics of |Δ log-prob| between the rollout server and the trainer after a weight sync, and
the gate they must pass.

In fp32 both sides agree to round-off, so the largest difference is a fine test. In bf16 every
kernel differs (attention, expert GEMMs, the router's top-k on near-ties), so single tokens can be
far apart while the weights are exactly right: the gate is on the masked mean and a quantile, and
the max is only logged. The bounds below come from measurements on CPU with a real vLLM server,
both sides in the same dtype (tests/integration/test_verification_servers.py; numbers next to `LIMITS`).
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
