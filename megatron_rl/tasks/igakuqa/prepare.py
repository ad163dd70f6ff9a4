"""IgakuQA → prompt and SFT JSONL files (`megatron-rl data prepare igakuqa`).

`prepare_igakuqa` writes, into `out`:
  igakuqa_train.jsonl  RL prompts (PromptRecord) of the training years
  igakuqa_eval.jsonl   RL prompts of the evaluation years — every question, so generations for it
                       can be scored with `megatron-rl eval igakuqa` under the official rule
  igakuqa_sft.jsonl    SFT pairs (SFTRecord) for the training prompts; IgakuQA has no written
                       explanations, so the target is the templated answer "[ans]a,c[/ans]"
  igakuqa_prepare.json counts, exclusions and per-file read statistics
Training leaves out questions that carry no usable signal: excluded from official scoring
(points 0), counted correct for every answer (116A71), and numeric-answer questions without
choices; optionally (`train_text_only`) questions whose image is missing from the data.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from ...data.prepare import PrepareResult
from ...data.schema import PromptRecord, SFTRecord, check_on_malformed
from ..mcq.prompts import build_messages, sft_target
from .data import ALL_CORRECT_IDS, IgakuQAQuestion, load_igakuqa

DEFAULT_EVAL_YEARS: tuple[int, ...] = (2022,)


def igakuqa_prompt(question: IgakuQAQuestion, system_prompt: str | None = None) -> PromptRecord:
    return PromptRecord(
        id=question.problem_id, source="igakuqa",
        messages=build_messages(question.problem_text, question.choices, language="ja",
                                system_prompt=system_prompt),
        answer=list(question.answer), choices=list(question.choices),
        alternatives=[list(alt) for alt in question.alternatives],
        metadata={"exam": question.exam, "year": question.year, "block": question.block,
                  "category": question.category, "kinki": list(question.kinki),
                  "points": question.points, "text_only": question.text_only,
                  "required": question.required},
    )


def _training_exclusion(question: IgakuQAQuestion, text_only: bool) -> str | None:
    """Why a question is left out of training (None: keep it)."""
    if question.problem_id in ALL_CORRECT_IDS:
        return "all_answers_correct"
    if question.points == 0:
        return "excluded_from_scoring"
    if not question.choices:
        return "numeric_answer"
    if text_only and not question.text_only:
        return "needs_image"
    return None


def _check_years(train: set[int], evaluation: set[int], available: set[int]) -> None:
    overlap = train & evaluation
    if overlap:
        raise ValueError(f"years {sorted(overlap)} are both training and evaluation years")
    unknown = (train | evaluation) - available
    if unknown:
        raise ValueError(f"no IgakuQA data for years {sorted(unknown)}; "
                         f"available: {sorted(available)}")


def prepare_igakuqa(src: str | os.PathLike[str], out: str | os.PathLike[str], *,
                    train_years: Iterable[int] | None = None,
                    eval_years: Iterable[int] = DEFAULT_EVAL_YEARS,
                    on_malformed: str = "error", train_text_only: bool = False,
                    system_prompt: str | None = None) -> PrepareResult:
    """Split IgakuQA by year into train/eval prompt files (+ SFT pairs); see module docstring.
    `system_prompt`: None = the project's Japanese one (`tasks/mcq/prompts.py`), "" = no system message."""
    dataset = load_igakuqa(src, on_malformed=check_on_malformed(on_malformed))
    available = set(dataset.years)
    evaluation = set(eval_years)
    train = set(train_years) if train_years is not None else available - evaluation
    _check_years(train, evaluation, available)
    excluded: Counter[str] = Counter()
    train_prompts: list[PromptRecord] = []
    eval_prompts: list[PromptRecord] = []
    for question in dataset.questions:
        if question.year in evaluation:
            eval_prompts.append(igakuqa_prompt(question, system_prompt))
        elif question.year in train:
            reason = _training_exclusion(question, train_text_only)
            if reason is None:
                train_prompts.append(igakuqa_prompt(question, system_prompt))
            else:
                excluded[reason] += 1
    sft = [SFTRecord(id=p.id, source=p.source, messages=p.messages,
                     response=sft_target(p.answer), metadata=p.metadata) for p in train_prompts]
    result = PrepareResult(excluded=dict(excluded),
                           read_stats=[s.to_dict() for s in dataset.stats])
    result.years = {"train": sorted(train), "eval": sorted(evaluation)}
    result.write(out, "igakuqa_train", train_prompts)
    result.write(out, "igakuqa_eval", eval_prompts)
    result.write(out, "igakuqa_sft", sft)
    result.write_summary(Path(out) / "igakuqa_prepare.json")
    return result
