"""A plan as a readable table (`render`) or plain JSON data (`to_json`)."""

from __future__ import annotations

from typing import Any

from .host import NodeMemory
from .memory import RolloutMemory, describe
from .plan import SAFE_MARGIN_PCT, Estimate, Plan, Suggestion
from .timing import StepTime


def _verdict(est: Estimate) -> str:
    if est.problems:
        return "INVALID LAYOUT: " + "; ".join(est.problems)
    largest = est.stage.largest
    status = "FITS" if est.fits else "DOES NOT FIT"
    why = "" if est.rollout.fits or est.margin_gb < 0 else " (the rollout server does not fit)"
    if not why and est.margin_gb >= 0 and not est.hosts_fit:
        why = " (a node's host memory does not: see below)"
    over = est.peaks_over(est.capacity_gb)
    if not why and est.margin_gb >= 0 and est.hosts_fit and over:
        why = " (" + ", ".join(f"{t.label}: {t.gb:.1f} GB" for t in over) + ")"
    if est.fits and not est.comfortable:
        why = f" (thin: under the {SAFE_MARGIN_PCT:g}% safety margin)"
    return (f"{status}{why}: margin {est.margin_gb:+.1f} GB ({est.margin_pct:+.1f}% of "
            f"{est.capacity_gb:g} GB); largest term: {largest.label} ({largest.gb:.1f} GB)")


def _rollout_line(r: RolloutMemory) -> str:
    head = (f"rollout ({r.placement}): {r.servers} vLLM server(s) × TP{r.tp} DP{r.dp} "
            f"(experts over {r.ep}) on {r.gpus} GPUs")
    if r.problem:
        return f"{head}: {r.problem}"
    return (f"{head}; per GPU: {r.reserved_gb:.1f} GB reserved = weights {r.weights_gb:.1f} + "
            f"runtime {r.runtime_gb:.1f} + KV cache {r.kv_budget_gb:.1f} GB "
            f"→ {r.sequences_per_server:.0f} max-length sequences per server"
            f"{'' if r.fits else ' — DOES NOT FIT'}")


def _suggestion_rows(suggestions: tuple[Suggestion, ...]) -> list[str]:
    if not suggestions:
        return ["  none in the search space"]
    timed = any(s.estimate.time is not None for s in suggestions)
    rows = [f"  {'#':>2}  {'TP':>2} {'PP':>2} {'EP':>3} {'ETP':>3}  {'recompute':<9} "
            f"{'optimizer':<9} {'GB/GPU':>7} {'margin':>7}" + (f" {'s/step':>7}" if timed else "")]
    for i, s in enumerate(suggestions, 1):
        p, e = s.parallelism, s.estimate
        rows.append(f"  {i:>2}  {p.tensor_model_parallel_size:>2} {p.pipeline_model_parallel_size:>2} "
                    f"{p.expert_model_parallel_size:>3} {p.expert_tensor_parallel_size or '-':>3}  "
                    f"{p.recompute_granularity:<9} {'CPU' if p.optimizer_cpu_offload else 'GPU':<9} "
                    f"{e.total_gb:>7.1f} {e.margin_pct:>6.1f}%"
                    + (f" {e.time.seconds:>7.1f}" if timed and e.time is not None else ""))
    return rows


def _node_rows(n: NodeMemory) -> list[str]:
    gpu = "FITS" if n.gpu_fits else "DOES NOT FIT"
    host = "FITS" if n.host_fits else "DOES NOT FIT"
    rows = [f"{n.role} (× {n.nodes}): GPU {n.gpu_total_gb:.1f} of {n.gpu_capacity_gb:g} GB per GPU: {gpu}; "
            f"host {n.host_total_gb:.1f} of {n.host_capacity_gb:g} GB: {host} (margin {n.host_margin_gb:+.1f} GB)"]
    rows += [f"  {t.label:<36} {t.gb:>7.2f}  {t.note}{' (reclaimable, not summed)' if t.reclaimable else ''}"
             for t in n.host_terms]
    return rows


def _time_rows(t: StepTime) -> list[str]:
    rows = [f"time per step on {t.gpu} ({t.gpus} GPUs):", f"  {'phase':<44} {'seconds':>8}  note"]
    rows += [f"  {p.label:<44} {p.seconds:>8.1f}  {p.note}" for p in t.phases]
    rows.append(f"  {'step':<44} {t.seconds:>8.1f}  {t.tokens_per_s_per_gpu:.1f} tokens/s/GPU "
                f"({t.tokens / 1e6:.2f} M prompt + response tokens)")
    if t.overlapped:
        rows.append("  (asynchronous rollout: the step is the sync plus the longer of the rollout and "
                    "log-probs + train, which run side by side)")
    if t.modelled:
        rows.append("  modelled although refused here: " + "; ".join(t.modelled))
    return rows


def render(plan: Plan) -> str:
    est, prm, hw = plan.estimate, plan.params, plan.hardware
    lines = [f"plan: {plan.recipe}",
             f"model: {prm.architecture}, {prm.total / 1e9:.2f} B parameters "
             f"({prm.active / 1e9:.2f} B active per token)",
             f"trainer: {est.cfg.parallelism.world_size // hw.gpus_per_node} nodes × {hw.gpus_per_node} GPUs × "
             f"{hw.gpu_memory_gb:g} GB; {describe(est.cfg)}",
             f"worst GPU: pipeline stage {est.stage.stage} of {est.cfg.parallelism.pipeline_model_parallel_size} "
             f"({est.stage.num_layers} layers)", "",
             f"  {'term':<36} {'GB/GPU':>7}  note"]
    lines += [f"  {t.label:<36} {t.gb:>7.2f}  {t.note}" for t in est.stage.terms]
    lines += [f"  {'total':<36} {est.total_gb:>7.2f}", f"  {'capacity':<36} {est.capacity_gb:>7.2f}"]
    if est.peaks:
        lines += ["", "  outside the step (GPU total at that moment):"]
        lines += [f"  {t.label:<36} {t.gb:>7.2f}  {t.note}" for t in est.peaks]
    lines += ["", f"verdict: {_verdict(est)}", _rollout_line(est.rollout), "",
              f"host memory per node (GB; capacity {plan.hardware.host_memory_gb:g} GB, --host-memory-gb):"]
    for node in est.nodes:
        lines += _node_rows(node)
    if est.time is not None:
        lines += [""] + _time_rows(est.time)
    order = ("fastest first" if any(s.estimate.time is not None for s in plan.suggestions) else
             "best first: GPU optimizer, no recompute, small TP·PP, small PP, then EP")
    lines += ["", f"layouts that fit with >= {SAFE_MARGIN_PCT:g}% margin ({order}):"]
    return "\n".join(lines + _suggestion_rows(plan.suggestions)) + "\n"


def _estimate_json(est: Estimate) -> dict[str, Any]:
    r = est.rollout
    return {
        "layout": describe(est.cfg),
        "stage": est.stage.stage,
        "stage_layers": est.stage.num_layers,
        "terms_gb": {t.key: round(t.gb, 3) for t in est.stage.terms},
        "peaks_gb": {t.key: round(t.gb, 3) for t in est.peaks},
        "host_optimizer_gb": round(est.stage.host_gb, 3),
        "total_gb": round(est.total_gb, 3),
        "capacity_gb": est.capacity_gb,
        "margin_gb": round(est.margin_gb, 3),
        "margin_pct": round(est.margin_pct, 2),
        "largest_term": est.stage.largest.key,
        "fits": est.fits,
        "problems": list(est.problems),
        "nodes": [_node_json(n) for n in est.nodes],
        "time": None if est.time is None else _time_json(est.time),
        "rollout": {"placement": r.placement, "tp": r.tp, "dp": r.dp, "ep": r.ep, "gpus": r.gpus,
                    "servers": r.servers, "reserved_gb": round(r.reserved_gb, 3),
                    "weights_gb": round(r.weights_gb, 3), "kv_budget_gb": round(r.kv_budget_gb, 3),
                    "sequences_per_server": round(r.sequences_per_server, 1), "fits": r.fits,
                    "problem": r.problem},
    }


def _node_json(n: NodeMemory) -> dict[str, Any]:
    return {"role": n.role, "nodes": n.nodes, "gpu_gb": round(n.gpu_total_gb, 3), "gpu_fits": n.gpu_fits,
            "host_terms_gb": {t.key: round(t.gb, 3) for t in n.host_terms},
            "host_reclaimable": [t.key for t in n.host_terms if t.reclaimable],
            "host_gb": round(n.host_total_gb, 3), "host_capacity_gb": n.host_capacity_gb, "host_fits": n.host_fits}


def _time_json(t: StepTime) -> dict[str, Any]:
    return {"gpu": t.gpu, "gpus": t.gpus, "phases_s": {p.key: round(p.seconds, 3) for p in t.phases},
            "step_s": round(t.seconds, 3), "overlapped": t.overlapped,
            "tokens_per_s_per_gpu": round(t.tokens_per_s_per_gpu, 2),
            "tokens": t.tokens, "modelled": list(t.modelled)}


def to_json(plan: Plan) -> dict[str, Any]:
    prm = plan.params
    return {
        "recipe": plan.recipe,
        "hardware": {"gpus_per_node": plan.hardware.gpus_per_node,
                     "gpu_memory_gb": plan.hardware.gpu_memory_gb, "gpu": plan.hardware.gpu,
                     "host_memory_gb": plan.hardware.host_memory_gb},
        "model": {"architecture": prm.architecture, "total_params": prm.total,
                  "active_params": prm.active, "non_embedding_params": prm.non_embedding,
                  "breakdown": prm.breakdown()},
        **_estimate_json(plan.estimate),
        "suggestions": [{"overrides": s.overrides(), **_estimate_json(s.estimate)}
                        for s in plan.suggestions],
    }
