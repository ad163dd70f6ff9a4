"""The start-up summary `train` prints once (rank 0), after the first weight sync is verified."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..config.schema import RecipeConfig
from ..console import summary
from ..tasks import LoadedTask


def startup_summary(cfg: RecipeConfig, session: Any, task: LoadedTask, start: int,
                    verified: dict[str, float]) -> str:
    p, r = cfg.parallelism, cfg.rollout
    world = dist.get_world_size()
    dp = p.data_parallel_size
    arch = (session.hf.get("architectures") or ["?"])[0]
    dtype = str(session.dtype).removeprefix("torch.")
    servers = ", ".join(s.base_url for s in session.servers) or "none"
    rewards = ", ".join(f"{name} ×{weight:g}" for name, weight in task.weights.items())
    steps = f"{start + 1}..{session.total_steps}" if start else f"{session.total_steps}"
    rows = [
        ("model", f"{arch}, {session.hf.get('num_hidden_layers', '?')} layers, {dtype} ({session.hf_dir})"),
        ("layout", f"{world} process(es): TP {p.tensor_model_parallel_size} · PP {p.pipeline_model_parallel_size}"
                   f" · EP {p.expert_model_parallel_size} · DP {dp}"),
        ("algorithm", f"{cfg.algorithm.name}, {cfg.algorithm.steps_per_generation} update(s) per rollout"),
        ("task", f"{task.task.name}: {rewards}"),
        ("server", f"{servers} (weights verified: |Δ log-prob| mean {verified['sync/verify_mean_abs_diff']:.2g}, "
                   f"max {verified['sync/verify_max_abs_diff']:.2g})"),
        ("verify gate", f"noise floor mean {verified.get('sync/verify_floor_mean', float('nan')):.2g}, "
                        f"p90 {verified.get('sync/verify_floor_p90', float('nan')):.2g} → later syncs within mean "
                        f"{verified.get('sync/verify_bound_mean', float('nan')):.2g}, "
                        f"p90 {verified.get('sync/verify_bound_p90', float('nan')):.2g}"),
        ("steps", f"{steps} × {session.prompts_per_step} prompts × {r.n} samples"),
        ("run dir", str(session.run_dir)),
    ]
    return f"megatron-rl train\n{summary(rows)}"
