"""`megatron-rl data generate chord-sft`: CHORD's expert texts from multiple-choice prompts, by a model
on a rollout server, in article 001's two stages ("MCQ → natural-language question → a five-part
medical text", its `generate_chord.py`, which is not published).

Stage 1 asks the model to rewrite each MCQ (its question and lettered choices, with the gold answer)
as one natural-language question. Stage 2 writes the answer one part at a time: for part k the model
sees the question, the gold answer, the parts 1..k−1 already written and part k's title and
instruction, and writes that part's text only. Asking part by part makes the five parts a property
of the pipeline rather than of the model's formatting (a model that drops or renames a heading
would otherwise lose its row), at five short generations instead of one long one. The prompts are
files a user edits (`megatron_rl/data/chord_prompts/`, `--prompts DIR`; `ExpertPrompts`).

The output is the CHORD expert-text format (`data/chord_sft.py`: `{id, question, sections: [{title,
text}, …], source, metadata}`), which `data prepare chord-sft --parts 5` turns into `data.sft_path`
rows unchanged. It is written row by row through `data/resumable.py`: a run that is killed keeps
every row it wrote, and the same command run again continues with the prompts not yet done. A
question whose stage-1 or part output comes back empty is not written (counted; a rerun tries it
again).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..config.schema import RolloutConfig
from ..console import Progress
from ..data.prompts import prompt_token_ids
from ..data.resumable import ResumableJsonl
from ..data.schema import DataError, PromptRecord
from ..tasks.mcq.prompts import CHOICE_INSTRUCTION
from .client import RolloutClient

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "chord_prompts"
SECTION_HEAD = "【{title}】"
NO_PREVIOUS = "（まだありません）"
QUESTION_FIELDS = frozenset({"mcq", "answer"})
ANSWER_FIELDS = frozenset({"question", "answer", "title", "instruction", "previous"})
SOURCE = "chord-generated"


@dataclass(frozen=True)
class ExpertPrompts:
    question: str
    """Stage 1's user turn (fields `QUESTION_FIELDS`)."""
    answer: str
    """Stage 2's user turn for one part (fields `ANSWER_FIELDS`)."""
    parts: tuple[tuple[str, str], ...]
    """(title, instruction) of each part, in order."""
    source: str = ""


def _template(path: Path, allowed: frozenset[str], required: set[str]) -> str:
    text = path.read_text(encoding="utf-8").strip()
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as exc:
        raise DataError(f"not a template ({exc}; write a literal brace as {{{{ or }}}})", path) from None
    unknown, missing = sorted(fields - allowed), sorted(required - fields)
    if unknown:
        raise DataError(f"unknown fields {unknown}; allowed: {sorted(allowed)}", path)
    if missing:
        raise DataError(f"the template must use {['{' + m + '}' for m in missing]}", path)
    return text


def load_prompts(folder: str | Path | None = None) -> ExpertPrompts:
    """question.txt, answer.txt and parts.txt of `folder` (default: the shipped ones)."""
    root = Path(folder) if folder is not None else DEFAULT_PROMPTS
    for name in ("question.txt", "answer.txt", "parts.txt"):
        if not (root / name).is_file():
            raise DataError(f"missing {name} (see {DEFAULT_PROMPTS / 'README.md'})", root)
    parts = []
    for lineno, line in enumerate((root / "parts.txt").read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        title, sep, instruction = line.partition("\t")
        if not sep or not title.strip():
            raise DataError("a part is 'title<TAB>instruction'", root / "parts.txt", lineno)
        parts.append((title.strip(), instruction.strip()))
    if not parts:
        raise DataError("no parts", root / "parts.txt")
    return ExpertPrompts(question=_template(root / "question.txt", QUESTION_FIELDS, {"mcq"}),
                         answer=_template(root / "answer.txt", ANSWER_FIELDS, {"question", "title"}),
                         parts=tuple(parts), source=str(root))


def mcq_fields(record: PromptRecord) -> dict[str, str]:
    """{mcq}: the record's user turn without the answer-format instruction; {answer}: the gold."""
    user = next((m["content"] for m in reversed(record.messages) if m["role"] == "user"), "")
    for instruction in CHOICE_INSTRUCTION.values():
        user = user.replace(instruction, "")
    letters = sorted(record.answer)
    texts = []
    for letter in letters:
        index = ord(letter) - ord("a")
        choice = record.choices[index] if 0 <= index < len(record.choices) else ""
        texts.append(f"{letter}. {choice}".strip() if choice else letter)
    return {"mcq": user.strip(), "answer": "、".join(texts)}


def _previous(sections: Sequence[tuple[str, str]]) -> str:
    return "\n\n".join(f"{SECTION_HEAD.format(title=t)}\n{x}" for t, x in sections) or NO_PREVIOUS


@dataclass
class GenerateResult:
    written: int = 0
    already_done: int = 0
    empty: list[str] = field(default_factory=list)
    """Ids whose stage-1 or part output came back empty (not written; a rerun tries them again)."""
    torn_bytes: int = 0


Generate = Callable[[list[list[dict[str, str]]]], list[str]]


def client_generate(client: RolloutClient, tokenizer: Any, settings: RolloutConfig, greedy: bool,
                    chat_template_kwargs: dict[str, Any] | None = None) -> Generate:
    """Chat turns → the model's texts, one each, through a rollout server."""
    def generate(conversations: list[list[dict[str, str]]]) -> list[str]:
        ids = [prompt_token_ids(tokenizer, messages, chat_template_kwargs) for messages in conversations]
        samples = client.generate(ids, settings, greedy=greedy)
        return [tokenizer.decode(group[0].response_ids, skip_special_tokens=True).strip() for group in samples]

    return generate


def _expert_rows(batch: Sequence[PromptRecord], prompts: ExpertPrompts, generate: Generate,
                 model: str) -> list[dict[str, Any] | None]:
    """One expert-text row per record (None where an output came back empty)."""
    fields = [mcq_fields(r) for r in batch]
    questions = generate([[{"role": "user", "content": prompts.question.format(**f)}] for f in fields])
    sections: list[list[tuple[str, str]]] = [[] for _ in batch]
    alive = [i for i, q in enumerate(questions) if q]
    for title, instruction in prompts.parts:
        if not alive:
            break
        turns = [[{"role": "user", "content": prompts.answer.format(
            question=questions[i], answer=fields[i]["answer"], title=title, instruction=instruction,
            previous=_previous(sections[i]))}] for i in alive]
        for i, text in zip(alive, generate(turns), strict=True):
            sections[i].append((title, text))
        alive = [i for i in alive if sections[i][-1][1]]
    rows: list[dict[str, Any] | None] = []
    for i, record in enumerate(batch):
        if i not in alive:
            rows.append(None)
            continue
        rows.append({"id": record.id, "question": questions[i],
                     "sections": [{"title": t, "text": x} for t, x in sections[i]], "source": SOURCE,
                     "metadata": {"from": record.source, "answer": list(record.answer), "model": model}})
    return rows


def generate_expert_texts(records: Sequence[PromptRecord], out: str | Path, prompts: ExpertPrompts,
                          generate: Generate, *, model: str = "", batch_size: int = 64,
                          progress: TextIO | None = None) -> GenerateResult:
    """Append the expert texts of the records not yet in `out`, `batch_size` records at a time, with
    a progress bar on `progress` (the caller's current `sys.stderr`, not the one at import)."""
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        raise DataError("the prompt file repeats an id; each id becomes one expert text")
    with ResumableJsonl(out) as writer:
        result = GenerateResult(already_done=len(writer.done & set(ids)), torn_bytes=writer.torn)
        pending = [r for r in records if r.id not in writer.done]
        bar = Progress(first=result.already_done + 1, total=len(records))
        for start in range(0, len(pending), batch_size):
            batch = pending[start:start + batch_size]
            for record, row in zip(batch, _expert_rows(batch, prompts, generate, model), strict=True):
                if row is None:
                    result.empty.append(record.id)
                else:
                    writer.append(row)
                    result.written += 1
            if progress is not None:
                done = result.already_done + start + len(batch)
                progress.write(f"\rexpert texts {bar.line(done)}")
                progress.flush()
        if progress is not None and pending:
            progress.write("\n")
    return result
