"""Exact reduction of objective metrics across micro-batches and DP ranks.

Objectives emit only additive quantities (sums, counts) and extrema, so means and
fractions are computed once at the end from global totals instead of averaging
per-micro-batch means (which would weight micro-batches, not tokens). Key format:

* ``loss/<name>``: a micro-batch's share of a global loss term → summed.
* ``const/<name>``: identical everywhere (e.g. CHORD's μ) → first value.
* ``<unit>/count``: the unit's denominator (``token``, ``seq``, ``sft_token``, ...).
* ``<unit>/<x>_sum``   → ``<unit>/<x>_mean`` = Σ sum / Σ ``<unit>/count``.
* ``<unit>/<x>_count`` → ``<unit>/<x>_frac`` = Σ count / Σ ``<unit>/count``
  (the summed ``<unit>/<x>_count`` is reported too).
* ``<unit>/<x>_min`` / ``_max`` → min / max (NaN when the unit was empty).

Typical use: ``combine_metrics`` over the local micro-batches, optionally
``all_reduce_metrics`` over the DP group, then ``finalize_metrics``;
``reduce_metrics`` does the local part and the finalization in one call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

_COMBINE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "loss": torch.add,
    "denominator": torch.add,
    "count": torch.add,
    "sum": torch.add,
    "min": torch.minimum,
    "max": torch.maximum,
    "const": lambda first, _other: first,
}
_DIST_OP: dict[str, dist.ReduceOp.RedOpType] = {
    "loss": dist.ReduceOp.SUM,
    "denominator": dist.ReduceOp.SUM,
    "count": dist.ReduceOp.SUM,
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def _keep(key: str, value: float, total: float) -> dict[str, float]:
    return {key: value}


def _mean(key: str, value: float, total: float) -> dict[str, float]:
    return {key.removesuffix("_sum") + "_mean": _ratio(value, total)}


def _fraction(key: str, value: float, total: float) -> dict[str, float]:
    return {key: value, key.removesuffix("_count") + "_frac": _ratio(value, total)}


def _extremum(key: str, value: float, total: float) -> dict[str, float]:
    # ±inf is the identity of an empty min/max; report it as "no data".
    return {key: value if math.isfinite(value) else math.nan}


_FINALIZE: dict[str, Callable[[str, float, float], dict[str, float]]] = {
    "loss": _keep,
    "const": _keep,
    "denominator": _keep,
    "sum": _mean,
    "count": _fraction,
    "min": _extremum,
    "max": _extremum,
}


def metric_kind(key: str) -> str:
    """``loss``, ``const``, ``denominator``, ``count``, ``sum``, ``min`` or ``max``."""
    prefix, _, name = key.partition("/")
    if prefix in ("loss", "const"):
        return prefix
    if name == "count":
        return "denominator"
    kind = name.rsplit("_", 1)[-1]
    if "_" not in name or kind not in _FINALIZE:
        raise ValueError(f"metric {key!r} does not follow '<unit>/<name>_<sum|count|min|max>'")
    return kind


def combine_metrics(metrics: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Combine raw micro-batch metrics (float64, detached); keys may differ between them."""
    out: dict[str, Tensor] = {}
    for m in metrics:
        for key, value in m.items():
            value = value.detach().to(torch.float64).reshape(())
            out[key] = _COMBINE[metric_kind(key)](out[key], value) if key in out else value
    return out


def all_reduce_metrics(
    metrics: dict[str, Tensor],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """Combine raw metrics over ``group``; every rank must hold the same keys.

    One collective per reduction op; ``const/*`` values are left as they are.
    """
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    out = dict(metrics)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        keys = sorted(k for k in metrics if _DIST_OP.get(metric_kind(k)) == op)
        if not keys:
            continue
        packed = torch.stack([metrics[k].to(device=device, dtype=torch.float64).reshape(()) for k in keys])
        dist.all_reduce(packed, op=op, group=group)
        out.update({k: packed[i].cpu() for i, k in enumerate(keys)})
    return out


def finalize_metrics(metrics: dict[str, Tensor]) -> dict[str, float]:
    """Turn combined sums/counts into means and fractions (plain floats)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        unit = key.partition("/")[0]
        total = float(metrics[f"{unit}/count"]) if f"{unit}/count" in metrics else math.nan
        out.update(_FINALIZE[metric_kind(key)](key, float(value), total))
    return out


def reduce_metrics(metrics: Sequence[dict[str, Tensor]]) -> dict[str, float]:
    """Means/fractions over a list of micro-batch metric dicts (this process only)."""
    return finalize_metrics(combine_metrics(metrics))
