"""CHORD's expert data from expert texts: `megatron-rl data prepare chord-sft`.

Article 001 trained CHORD with `sft_igakuqa.jsonl`: natural-language medical questions, each
answered by a five-part medical text that a two-stage generator (`generate_chord.py`, not
published) wrote. The parts are not named in 001. This module turns such texts, however they were
written, into the SFT rows CHORD reads (`data.sft_path`, `SFTRecord`).

Input: one JSON object per line (the **CHORD expert-text format**):

    {"id": "q-0001",                                   # unique, str
     "question": "自然言語の質問 …",                     # the user turn, str
     "sections": [{"title": "病態", "text": "…"},       # the expert answer in parts, in order,
                  {"title": "診断", "text": "…"}, …],    #   each with a non-empty text;
     "source": "igakuqa-2019",                         # optional, str (default "chord-sft")
     "metadata": {…}}                                   # optional, kept as is

or, for an answer that is one text, `"response": "…"` instead of `"sections"`. A section's
`title` may be empty; a titled section is written as `【title】` on its own line before its text,
sections separated by a blank line.

Output (`chord_sft.jsonl`): `{"id", "source", "messages": [system?, user], "response",
"metadata"}` with `metadata.parts` = the number of sections. `parts` (e.g. 5 for 001's texts)
refuses a row with another number of sections; `system_prompt` adds a system message (none by
default: ms-swift's Qwen3 templates add none unless the data has one); `exclude` drops rows whose
question is also a prompt of the given prompt files (evaluation questions must not be taught).
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .schema import DataError, Location, ReadStats, SFTRecord, optional, read_jsonl, read_prompts, require

SECTION_HEAD = "【{title}】"


@dataclass(frozen=True)
class ExpertText:
    id: str
    question: str
    sections: tuple[tuple[str, str], ...]
    """(title, text) in order; one untitled section for a `response` row."""
    source: str = "chord-sft"
    metadata: dict[str, Any] = field(default_factory=dict)

    def response(self) -> str:
        parts = [f"{SECTION_HEAD.format(title=t)}\n{x}" if t else x for t, x in self.sections]
        return "\n\n".join(parts)


def _sections(obj: dict[str, Any], loc: Location) -> tuple[tuple[str, str], ...]:
    has_sections, has_response = "sections" in obj, "response" in obj
    if has_sections == has_response:
        raise loc.error("give exactly one of 'sections' (the expert text in parts) or 'response' (one text)")
    if has_response:
        text = require(obj, "response", str, loc).strip()
        if not text:
            raise loc.error("key 'response' must not be empty")
        return (("", text),)
    raw = require(obj, "sections", list, loc)
    if not raw:
        raise loc.error("key 'sections' must not be empty")
    out = []
    for i, section in enumerate(raw):
        if not isinstance(section, dict):
            raise loc.error(f"sections[{i}] must be an object with 'title' and 'text'")
        title, text = section.get("title", ""), section.get("text")
        if not isinstance(title, str) or not isinstance(text, str) or not text.strip():
            raise loc.error(f"sections[{i}] needs a non-empty str 'text' (and a str 'title', may be empty)")
        out.append((title.strip(), text.strip()))
    return tuple(out)


def _parse(obj: dict[str, Any], loc: Location) -> ExpertText:
    question = require(obj, "question", str, loc).strip()
    if not question:
        raise loc.error("key 'question' must not be empty")
    return ExpertText(id=require(obj, "id", str, loc), question=question, sections=_sections(obj, loc),
                      source=optional(obj, "source", str, loc, "chord-sft"),
                      metadata=optional(obj, "metadata", dict, loc, {}))


def read_expert_texts(path: str | os.PathLike[str], *, on_malformed: str = "error",
                      stats: ReadStats | None = None) -> list[ExpertText]:
    return list(read_jsonl(path, _parse, on_malformed=on_malformed, stats=stats))


def _key(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).split())


def held_out_questions(paths: Iterable[str | os.PathLike[str]]) -> set[str]:
    """The user turns of prompt files (normalized): questions that must not become SFT rows."""
    out: set[str] = set()
    for path in paths:
        for record in read_prompts(path):
            out.update(_key(m["content"]) for m in record.messages if m["role"] == "user")
    return out


def sft_rows(texts: list[ExpertText], *, parts: int | None = None, system_prompt: str = "",
             exclude: set[str] | None = None, limit: int | None = None) -> tuple[list[SFTRecord], dict[str, int]]:
    """SFT rows and the count of rows left out per reason."""
    rows: list[SFTRecord] = []
    left_out: dict[str, int] = {}
    seen: set[str] = set()
    for t in texts:
        if t.id in seen:
            raise DataError(f"duplicate id {t.id!r}")
        seen.add(t.id)
        if parts is not None and len(t.sections) != parts:
            raise DataError(f"row {t.id!r} has {len(t.sections)} sections; --parts asks for {parts}")
        if exclude and _key(t.question) in exclude:
            left_out["question_in_excluded_prompts"] = left_out.get("question_in_excluded_prompts", 0) + 1
            continue
        if limit is not None and len(rows) >= limit:
            break
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
            [{"role": "user", "content": t.question}]
        rows.append(SFTRecord(id=t.id, source=t.source, messages=messages, response=t.response(),
                              metadata={**t.metadata, "parts": len(t.sections)}))
    return rows, left_out
