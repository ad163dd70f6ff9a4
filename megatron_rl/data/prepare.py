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

MedMCQA (`prepare_medmcqa`) writes medmcqa_<split>.jsonl (English prompts: the project's [ans]
format, or with `style="article000"` article 000's system prompt and A–D options),
medmcqa_<split>_sft.jsonl (explanation + answer when the source has an explanation, else the
answer alone) and medmcqa_<split>_prepare.json (with the `cop` base used and how it was found).

MedXpertQA (`prepare_medxpertqa`) writes medxpertqa_<split>.jsonl (evaluation prompts, options a–j)
and CHORD (`prepare_chord_sft`) chord_sft.jsonl (expert rows for `data.sft_path`, from the CHORD
expert-text format of `data/chord_sft.py`), each with its <name>_prepare.json.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.data.chord_sft import held_out_questions, read_expert_texts, sft_rows
from megatron_rl.data.igakuqa import ALL_CORRECT_IDS, IgakuQAQuestion, load_igakuqa
from megatron_rl.data.medmcqa import MedMCQAQuestion, detect_cop_base, read_medmcqa
from megatron_rl.data.medxpertqa import MedXpertQAQuestion, read_medxpertqa
from megatron_rl.data.prompts import article000_messages, build_messages, sft_target
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
    notes: dict[str, Any] = field(default_factory=dict)
    """Source-specific decisions worth a line (e.g. MedMCQA's `cop` base and how it was found)."""

    @property
    def skipped_lines(self) -> int:
        return sum(s["skipped"] for s in self.read_stats)

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files, "counts": self.counts, "excluded": self.excluded,
                "years": self.years, "notes": self.notes,
                "skipped_lines": self.skipped_lines, "read_stats": self.read_stats}


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
    `system_prompt`: None = the project's Japanese one (`data/prompts.py`), "" = no system message."""
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
    _write(result, out, "igakuqa_train", train_prompts)
    _write(result, out, "igakuqa_eval", eval_prompts)
    _write(result, out, "igakuqa_sft", sft)
    _write_summary(result, Path(out) / "igakuqa_prepare.json")
    return result


MEDMCQA_STYLES: tuple[str, ...] = ("project", "article000")


def medmcqa_prompt(question: MedMCQAQuestion, style: str = "project") -> PromptRecord:
    messages = article000_messages(question.question, question.options) if style == "article000" else \
        build_messages(question.question, question.options, language="en")
    return PromptRecord(
        id=f"medmcqa-{question.id}", source="medmcqa", messages=messages,
        answer=[question.answer], choices=list(question.options),
        metadata={"subject": question.subject, "topic": question.topic},
    )


def medmcqa_sft(question: MedMCQAQuestion, prompt: PromptRecord, style: str = "project") -> SFTRecord:
    tag = f"Answer: {question.answer.upper()}" if style == "article000" else sft_target([question.answer])
    response = f"{question.explanation.strip()}\n\n{tag}" if question.explanation.strip() else tag
    return SFTRecord(id=prompt.id, source=prompt.source, messages=prompt.messages,
                     response=response, metadata=prompt.metadata)


def prepare_medmcqa(src: str | os.PathLike[str], out: str | os.PathLike[str], *,
                    split: str = "train", cop_base: int | str = "auto", limit: int | None = None,
                    style: str = "project", on_malformed: str = "error") -> PrepareResult:
    """Convert one MedMCQA JSONL file (its first `limit` questions: `train[:limit]`) into RL prompts
    and SFT pairs; ids must be unique. `cop_base="auto"` reads it from the file's `cop` values."""
    if style not in MEDMCQA_STYLES:
        raise ValueError(f"style must be one of {', '.join(MEDMCQA_STYLES)}, got {style!r}")
    how = "given"
    if cop_base == "auto":
        cop_base, how = detect_cop_base(src, on_malformed)
    stats = ReadStats(str(src))
    questions = read_medmcqa(src, cop_base=int(cop_base), on_malformed=on_malformed, stats=stats, limit=limit)
    seen: set[str] = set()
    for question in questions:
        if question.id in seen:
            raise DataError(f"duplicate id {question.id!r}", src)
        seen.add(question.id)
    prompts = [medmcqa_prompt(q, style) for q in questions]
    sft = [medmcqa_sft(q, p, style) for q, p in zip(questions, prompts, strict=True)]
    result = PrepareResult(read_stats=[stats.to_dict()])
    result.notes = {"cop_base": int(cop_base), "cop_base_from": how, "limit": limit, "style": style}
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


def medxpertqa_prompt(question: MedXpertQAQuestion) -> PromptRecord:
    return PromptRecord(
        id=question.id, source="medxpertqa",
        messages=build_messages(question.stem, question.options, language="en"),
        answer=[question.answer], choices=list(question.options),
        metadata={"medical_task": question.medical_task, "body_system": question.body_system,
                  "question_type": question.question_type},
    )


def prepare_medxpertqa(src: str | os.PathLike[str], out: str | os.PathLike[str], *, split: str = "test",
                       limit: int | None = None, on_malformed: str = "error") -> PrepareResult:
    """MedXpertQA (Text; MM rows with images are left out) → medxpertqa_<split>.jsonl prompts for
    `eval generate` and `eval mcq`."""
    stats = ReadStats(str(src))
    questions = read_medxpertqa(src, on_malformed=on_malformed, stats=stats)
    excluded: Counter[str] = Counter()
    prompts: list[PromptRecord] = []
    seen: set[str] = set()
    for question in questions:
        if question.id in seen:
            raise DataError(f"duplicate id {question.id!r}", src)
        seen.add(question.id)
        if question.images:
            excluded["needs_image"] += 1
        elif limit is None or len(prompts) < limit:
            prompts.append(medxpertqa_prompt(question))
    result = PrepareResult(excluded=dict(excluded), read_stats=[stats.to_dict()])
    result.notes = {"limit": limit, "options": sorted({len(p.choices) for p in prompts})}
    _write(result, out, f"medxpertqa_{split}", prompts)
    _write_summary(result, Path(out) / f"medxpertqa_{split}_prepare.json")
    return result


def prepare_chord_sft(src: str | os.PathLike[str], out: str | os.PathLike[str], *, parts: int | None = None,
                      system_prompt: str = "", exclude: Iterable[str | os.PathLike[str]] = (),
                      limit: int | None = None, on_malformed: str = "error") -> PrepareResult:
    """Expert texts (the CHORD expert-text format, `data/chord_sft.py`) → chord_sft.jsonl for
    `data.sft_path`."""
    stats = ReadStats(str(src))
    texts = read_expert_texts(src, on_malformed=on_malformed, stats=stats)
    excluded_files = [str(p) for p in exclude]
    rows, left_out = sft_rows(texts, parts=parts, system_prompt=system_prompt,
                              exclude=held_out_questions(excluded_files) if excluded_files else None, limit=limit)
    result = PrepareResult(excluded=left_out, read_stats=[stats.to_dict()])
    result.notes = {"parts": parts, "system_prompt": system_prompt, "excluded_prompt_files": excluded_files,
                    "limit": limit}
    _write(result, out, "chord_sft", rows)
    _write_summary(result, Path(out) / "chord_sft_prepare.json")
    return result
