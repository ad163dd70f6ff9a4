"""Write RL prompt / SFT JSONL files from the raw sources (`megatron-rl data prepare ...`).

IgakuQA (`prepare_igakuqa`) writes, into `out`:
  igakuqa_train.jsonl  RL prompts (PromptRecord) of the training years
  igakuqa_eval.jsonl   RL prompts of the evaluation years — every question, so generations for it
                       can be scored with `megatron-rl eval igakuqa` under the official rule
  igakuqa_sft.jsonl    SFT pairs (SFTRecord) for the training prompts; IgakuQA has no written
                       explanations, so the target is the templated answer "[ans]a,c[/ans]"
  igakuqa_prepare.json counts, exclusions and per-file read statistics
Training leaves out questions that carry no usable signal: excluded from official scoring
(points 0), counted correct for every answer (116A71), and numeric-answer questions without
choices; optionally (`train_text_only`) questions whose image is missing from the data.

MedMCQA (`prepare_medmcqa`) writes medmcqa_<split>.jsonl (English prompts),
medmcqa_<split>_sft.jsonl (explanation + answer tag when the source has an explanation, else the
answer tag alone) and medmcqa_<split>_prepare.json.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.data.igakuqa import ALL_CORRECT_IDS, IgakuQAQuestion, load_igakuqa
from megatron_rl.data.medmcqa import MedMCQAQuestion, read_medmcqa
from megatron_rl.data.prompts import build_messages, sft_target
from megatron_rl.data.schema import (
    DataError,
    PromptRecord,
    ReadStats,
    SFTRecord,
    check_on_malformed,
    write_jsonl,
)

DEFAULT_EVAL_YEARS: tuple[int, ...] = (2022,)


@dataclass
class PrepareResult:
    files: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    excluded: dict[str, int] = field(default_factory=dict)
    read_stats: list[dict[str, Any]] = field(default_factory=list)
    years: dict[str, list[int]] = field(default_factory=dict)

    @property
    def skipped_lines(self) -> int:
        return sum(s["skipped"] for s in self.read_stats)

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files, "counts": self.counts, "excluded": self.excluded,
                "years": self.years,
                "skipped_lines": self.skipped_lines, "read_stats": self.read_stats}


def igakuqa_prompt(question: IgakuQAQuestion) -> PromptRecord:
    return PromptRecord(
        id=question.problem_id, source="igakuqa",
        messages=build_messages(question.problem_text, question.choices, language="ja"),
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
                    on_malformed: str = "error", train_text_only: bool = False) -> PrepareResult:
    """Split IgakuQA by year into train/eval prompt files (+ SFT pairs); see module docstring."""
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
            eval_prompts.append(igakuqa_prompt(question))
        elif question.year in train:
            reason = _training_exclusion(question, train_text_only)
            if reason is None:
                train_prompts.append(igakuqa_prompt(question))
            else:
                excluded[reason] += 1
    sft = [SFTRecord(id=p.id, source=p.source, messages=p.messages,
                     response=sft_target(p.answer), metadata=p.metadata) for p in train_prompts]
    result = PrepareResult(excluded=dict(excluded),
                           read_stats=[s.to_dict() for s in dataset.stats])
    result.years = {"train": sorted(train), "eval": sorted(evaluation)}
    _write(result, out, "igakuqa_train", train_prompts)
    _write(result, out, "igakuqa_eval", eval_prompts)
    _write(result, out, "igakuqa_sft", sft)
    _write_summary(result, Path(out) / "igakuqa_prepare.json")
    return result


def medmcqa_prompt(question: MedMCQAQuestion) -> PromptRecord:
    return PromptRecord(
        id=f"medmcqa-{question.id}", source="medmcqa",
        messages=build_messages(question.question, question.options, language="en"),
        answer=[question.answer], choices=list(question.options),
        metadata={"subject": question.subject, "topic": question.topic},
    )


def medmcqa_sft(question: MedMCQAQuestion, prompt: PromptRecord) -> SFTRecord:
    tag = sft_target([question.answer])
    response = f"{question.explanation.strip()}\n\n{tag}" if question.explanation.strip() else tag
    return SFTRecord(id=prompt.id, source=prompt.source, messages=prompt.messages,
                     response=response, metadata=prompt.metadata)


def prepare_medmcqa(src: str | os.PathLike[str], out: str | os.PathLike[str], *,
                    split: str = "train", cop_base: int = 1,
                    on_malformed: str = "error") -> PrepareResult:
    """Convert one MedMCQA JSONL file into RL prompts and SFT pairs; ids must be unique."""
    stats = ReadStats(str(src))
    questions = read_medmcqa(src, cop_base=cop_base, on_malformed=on_malformed, stats=stats)
    seen: set[str] = set()
    for question in questions:
        if question.id in seen:
            raise DataError(f"duplicate id {question.id!r}", src)
        seen.add(question.id)
    prompts = [medmcqa_prompt(q) for q in questions]
    sft = [medmcqa_sft(q, p) for q, p in zip(questions, prompts, strict=True)]
    result = PrepareResult(read_stats=[stats.to_dict()])
    _write(result, out, f"medmcqa_{split}", prompts)
    _write(result, out, f"medmcqa_{split}_sft", sft)
    _write_summary(result, Path(out) / f"medmcqa_{split}_prepare.json")
    return result


def _write(result: PrepareResult, out: str | os.PathLike[str], name: str,
           records: list[Any]) -> None:
    path = Path(out) / f"{name}.jsonl"
    result.counts[name] = write_jsonl(path, records)
    result.files[name] = str(path)


def _write_summary(result: PrepareResult, path: Path) -> None:
    path.write_text(json.dumps(result.to_dict(), ensure_ascii=False, indent=2) + "\n",
                    encoding="utf-8")
    result.files["summary"] = str(path)
