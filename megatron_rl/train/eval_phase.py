"""Periodic evaluation: the current policy on `data.eval_path`, scored with the recipe's rewards.

Rank 0 generates one sample per eval prompt on the rollout server (greedy unless
`evaluation.temperature` > 0) with the weights just synced, scores it with the same reward
functions and weights as training — and prompts prepared from IgakuQA (`data prepare igakuqa`)
also with the benchmark's own rule (`eval.scoring`: accepted answer sets, points, prohibited
choices) — and every rank gets the `eval/*` metrics.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from ..config.schema import RecipeConfig
from ..rollout.client import SamplingSettings
from ..types import RolloutGroup
from .batch import score_groups
from .rollout_phase import generate_groups
from .setup import Prompts, load_prompts


def load_eval_set(cfg: RecipeConfig, tokenizer: Any) -> Prompts | None:
    """The eval prompts (those within `rollout.max_prompt_length`), or None when evaluation is off."""
    if not cfg.evaluation.interval or not cfg.data.eval_path:
        return None
    prompts = load_prompts(cfg.data.eval_path, tokenizer, cfg.rollout.max_prompt_length, cfg.data.on_malformed)
    n = cfg.evaluation.max_prompts or len(prompts.records)
    return Prompts(prompts.records[:n], prompts.token_ids[:n], prompts.dicts[:n])


def eval_sampling(cfg: RecipeConfig) -> SamplingSettings:
    r, t = cfg.rollout, cfg.evaluation.temperature
    greedy = t == 0.0
    return SamplingSettings(1, t, 1.0 if greedy else r.top_p, -1 if greedy else r.top_k, r.max_response_length,
                            r.logprobs_mode)


def eval_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """Means over the eval prompts: total reward, each reward function (unweighted), accuracy (the
    `mcq_answer` reward) and response length."""
    rewards = [r for g in groups for r in g.rewards]
    parts = [p for g in groups for p in g.reward_parts]
    lengths = [len(s.response_ids) for g in groups for s in g.samples]
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    m = {"eval/reward_mean": mean(rewards), "eval/response_length_mean": mean(lengths),
         "eval/prompts": float(len(groups))}
    for name in parts[0] if parts else {}:
        m[f"eval/reward/{name}_mean"] = mean([p[name] for p in parts])
    if parts and "mcq_answer" in parts[0]:
        m["eval/accuracy"] = m["eval/reward/mcq_answer_mean"]
    m.update(igakuqa_metrics(groups))
    return m


def _igakuqa_question(record: dict[str, Any]) -> Any:
    """The scorer's question from a prompt record written by `data prepare igakuqa`."""
    from ..data.igakuqa import IgakuQAQuestion, parse_problem_id

    meta = record.get("metadata", {})
    exam, block, number = parse_problem_id(record["id"]) or (0, "", 0)
    return IgakuQAQuestion(problem_id=record["id"], exam=exam, block=block, number=number, problem_text="",
                           choices=tuple(record["choices"]), answer=tuple(record["answer"]),
                           alternatives=tuple(tuple(a) for a in record.get("alternatives", [])),
                           points=int(meta.get("points", 1)), text_only=bool(meta.get("text_only", True)),
                           kinki=tuple(meta.get("kinki", ())))


def igakuqa_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """The IgakuQA rule on the eval prompts that came from IgakuQA: accuracy, points earned / points
    possible, and how often a prohibited choice (kinki) was selected."""
    from ..eval.scoring import is_correct, selects_prohibited
    from ..rewards.mcq import extract_answer

    questions = [(_igakuqa_question(g.record), extract_answer(g.samples[0].text))
                 for g in groups if g.record.get("source") == "igakuqa"]
    if not questions:
        return {}
    correct = [is_correct(q, answer) for q, answer in questions]
    possible = sum(q.points for q, _ in questions)
    earned = sum(q.points for (q, _), ok in zip(questions, correct) if ok)
    return {"eval/igakuqa/questions": float(len(questions)),
            "eval/igakuqa/accuracy": sum(correct) / len(questions),
            "eval/igakuqa/score": earned / possible if possible else math.nan,
            "eval/igakuqa/prohibited_rate": sum(selects_prohibited(q, a) for q, a in questions) / len(questions)}


def evaluate(session: Any, eval_set: Prompts) -> dict[str, float]:
    """Generate and score on rank 0 (collective: every rank returns the metrics)."""
    box: list[Any] = [None]
    if session.rank0:
        cfg = session.cfg
        indices = list(range(len(eval_set.records)))
        groups = generate_groups(session.client, eval_set.token_ids, eval_set.dicts, indices, eval_sampling(cfg),
                                 session.version)
        score_groups(groups, cfg.rewards.weights,
                     lambda ids: session.tokenizer.decode(ids, skip_special_tokens=True))
        box[0] = eval_metrics(groups)
    dist.broadcast_object_list(box, src=0)
    return box[0]
