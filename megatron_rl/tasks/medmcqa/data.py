"""MedMCQA reader (Pal et al., 2022): one JSON object per line with `question`, `opa`–`opd`,
`cop` (correct option) and optionally `id`, `exp` (explanation), `subject_name`, `topic_name`,
`choice_type`.

`cop` is 1–4 in the original release (1 → "a" … 4 → "d"). The Hugging Face copy
(`openlifescienceai/medmcqa`, the one article 000 loaded) stores it 0–3. `detect_cop_base` tells
them apart by the values a file holds: a 0 only occurs in the 0-based copy and a 4 only in the
1-based one; a file with neither (or both) is refused with the values it holds, never guessed
(article 000's reward read the 0-based copy as 1-based: every gold letter shifted). A `cop`
outside the chosen range is a malformed line, never silently shifted.

`prepare_medmcqa` (`megatron-rl data prepare medmcqa`) writes medmcqa_<split>.jsonl (English
prompts: the project's [ans] format, or with `style="article000"` article 000's system prompt and
A–D options), medmcqa_<split>_sft.jsonl (explanation + answer when the source has an explanation,
else the answer alone) and medmcqa_<split>_prepare.json (with the `cop` base used and how it was
found).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...data.prepare import PrepareResult
from ...data.schema import DataError, Location, PromptRecord, ReadStats, SFTRecord, optional, read_jsonl, require
from ..mcq.prompts import build_messages, choice_letter, sft_target

OPTION_KEYS: tuple[str, ...] = ("opa", "opb", "opc", "opd")
LETTERS: tuple[str, ...] = ("a", "b", "c", "d")


@dataclass(frozen=True)
class MedMCQAQuestion:
    id: str
    question: str
    options: tuple[str, str, str, str]
    answer: str
    explanation: str = ""
    subject: str = ""
    topic: str = ""


def _optional_text(obj: dict[str, Any], key: str, loc: Location) -> str:
    # The released files use null for a missing explanation/topic.
    value = optional(obj, key, (str, type(None)), loc, None)
    return value or ""


def _parser(cop_base: int) -> Callable[[dict[str, Any], Location], MedMCQAQuestion]:
    def parse(obj: dict[str, Any], loc: Location) -> MedMCQAQuestion:
        question = require(obj, "question", str, loc)
        options = tuple(require(obj, key, str, loc) for key in OPTION_KEYS)
        cop = require(obj, "cop", int, loc)
        index = cop - cop_base
        if not 0 <= index < len(LETTERS):
            raise loc.error(f"key 'cop' must be in {cop_base}..{cop_base + 3}, got {cop}")
        raw_id = optional(obj, "id", (str, int), loc, None)
        return MedMCQAQuestion(
            id=str(raw_id) if raw_id is not None else f"line{loc.line}",
            question=question, options=options, answer=LETTERS[index],
            explanation=_optional_text(obj, "exp", loc),
            subject=_optional_text(obj, "subject_name", loc),
            topic=_optional_text(obj, "topic_name", loc),
        )

    return parse


def detect_cop_base(path: str | os.PathLike[str], on_malformed: str = "error") -> tuple[int, str]:
    """(0 or 1, why) from the `cop` values of every line; `DataError` when they cannot tell."""
    seen: set[int] = set()

    def collect(obj: dict[str, Any], loc: Location) -> None:
        seen.add(require(obj, "cop", int, loc))

    for _ in read_jsonl(path, collect, on_malformed=on_malformed):
        pass
    if 0 in seen and 4 in seen:
        raise DataError(f"key 'cop' takes both 0 and 4 (values {sorted(seen)}): neither MedMCQA's 1-4 nor the "
                        "Hugging Face copy's 0-3", path)
    if 0 in seen:
        return 0, f"cop values {sorted(seen)}: 0-based (the Hugging Face copy), 0 -> a"
    if 4 in seen:
        return 1, f"cop values {sorted(seen)}: 1-based (the original release), 1 -> a"
    raise DataError(f"key 'cop' takes only {sorted(seen)}: without a 0 or a 4 the file cannot tell the "
                    "Hugging Face copy (0-3) from the original release (1-4); pass --cop-base 0 or 1", path)


def read_medmcqa(path: str | os.PathLike[str], *, cop_base: int = 1, on_malformed: str = "error",
                 stats: ReadStats | None = None, limit: int | None = None) -> list[MedMCQAQuestion]:
    """The questions of a file (the first `limit` kept, in file order: `train[:limit]`)."""
    if cop_base not in (0, 1):
        raise ValueError(f"cop_base must be 0 or 1, got {cop_base}")
    out: list[MedMCQAQuestion] = []
    for question in read_jsonl(path, _parser(cop_base), on_malformed=on_malformed, stats=stats):
        if limit is not None and len(out) >= limit:
            break
        out.append(question)
    return out


# Article 000's system prompt (its ms-swift `system=`), verbatim: the MedMCQA run of
# recipes/qwen3_235b_a22b/gspo_qlora.yaml (`data prepare medmcqa --style article000`).
ARTICLE_000_SYSTEM = "\n".join([
    'You are a medical AI assistant solving multiple choice questions.',
    'Instructions:',
    '1. Read the question and all four options (A, B, C, D) carefully',
    '2. Think through the medical concepts and reasoning step by step',
    '3. Consider each option and eliminate incorrect ones',
    '4. Provide your final answer in EXACTLY one of these formats:',
    '- "Answer: [A/B/C/D]"',
    '- "答え: [A/B/C/D]"',
    '- "The correct answer is [A/B/C/D]"',
    '- "Final answer: [A/B/C/D]"',
    'Important: You MUST include your reasoning process before giving the final answer. '
    'The answer format must appear at the end of your response.',
])


def article000_messages(question: str, choices: Sequence[str]) -> list[dict[str, str]]:
    """Article 000's prompt: its system message verbatim; the user message is the question and,
    unlike the article's run (ms-swift mapped only `question` to the query), the options it asks
    about, lettered A–D as its system message names them. No [ans] instruction: the system
    message sets the answer format, which `medmcqa_strict` reads."""
    lines = [question.strip(), ""]
    lines.extend(f"{choice_letter(i).upper()}. {choice.strip()}" for i, choice in enumerate(choices))
    return [{"role": "system", "content": ARTICLE_000_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


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
    result.write(out, f"medmcqa_{split}", prompts)
    result.write(out, f"medmcqa_{split}_sft", sft)
    result.write_summary(Path(out) / f"medmcqa_{split}_prepare.json")
    return result
