"""Periodic evaluation: the current policy on `data.eval_path`, scored by the recipe's task.

Rank 0 generates one sample per eval prompt on the rollout server (greedy unless
`evaluation.temperature` > 0) with the weights just synced, scores it with the same reward
functions and weights as training plus the task's scorer and eval metrics (the `igakuqa` task adds
the benchmark's own rule: accepted answer sets, points, prohibited choices), and every rank gets
the `eval/*` metrics.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from ..config.schema import RecipeConfig
from ..rollout.client import SamplingSettings
from ..tasks import LoadedTask
from ..types import RolloutGroup
from .batch import Scores, score_groups
from .rollout_phase import generate_groups
from .setup import Prompts, load_prompts


def load_eval_set(cfg: RecipeConfig, tokenizer: Any, task: LoadedTask) -> Prompts | None:
    """The eval prompts (those within `rollout.max_prompt_length`), or None when evaluation is off."""
    if not cfg.evaluation.interval or not cfg.data.eval_path:
        return None
    prompts = load_prompts(cfg.data.eval_path, tokenizer, cfg.rollout.max_prompt_length, cfg.data.on_malformed,
                           task.task.prompt, cfg.rollout.chat_template_kwargs)
    n = cfg.evaluation.max_prompts or len(prompts.records)
    return Prompts(prompts.records[:n], prompts.token_ids[:n], prompts.dicts[:n])


def eval_sampling(cfg: RecipeConfig) -> SamplingSettings:
    r, t = cfg.rollout, cfg.evaluation.temperature
    greedy = t == 0.0
    return SamplingSettings(1, t, 1.0 if greedy else r.top_p, -1 if greedy else r.top_k, r.max_response_length,
                            r.logprobs_mode)


def eval_metrics(groups: list[RolloutGroup], scores: Scores, task: LoadedTask) -> dict[str, float]:
    """Means over the eval prompts: total reward, each reward function (unweighted), response
    length, and the task's own batch metrics (format rate, accuracy) and eval metrics."""
    lengths = [len(s.response_ids) for g in groups for s in g.samples]
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    m = {"eval/reward_mean": mean(scores.rewards), "eval/response_length_mean": mean(lengths),
         "eval/prompts": float(len(groups))}
    for name in scores.parts[0] if scores.parts else {}:
        m[f"eval/reward/{name}_mean"] = mean([p[name] for p in scores.parts])
    samples = [g.record for g in groups for _ in g.samples]
    m.update({f"eval/{k}": v for k, v in scores.task_metrics.items()})
    if task.task.eval_metrics is not None:
        m.update({f"eval/{k}": v for k, v in task.task.eval_metrics(scores.texts, samples).items()})
    return m


def evaluate(session: Any, eval_set: Prompts, task: LoadedTask, version: int) -> dict[str, float]:
    """Generate and score on rank 0 with the weights of `version` (collective: every rank returns
    the metrics)."""
    box: list[Any] = [None]
    if session.rank0:
        cfg = session.cfg
        indices = list(range(len(eval_set.records)))
        groups = generate_groups(session.client, eval_set.token_ids, eval_set.dicts, indices, eval_sampling(cfg),
                                 version)
        scores = score_groups(groups, task, lambda ids: session.tokenizer.decode(ids, skip_special_tokens=True))
        box[0] = eval_metrics(groups, scores, task)
    dist.broadcast_object_list(box, src=0)
    return box[0]
