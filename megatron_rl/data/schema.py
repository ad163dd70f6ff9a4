"""Record schemas (RL prompt, SFT pair) and the one JSONL reader/writer with line-numbered errors.

Every JSONL file the project reads goes through `read_jsonl`: it owns the error format
(`<path>:<line>: <problem>`) and the `on_malformed="skip"` policy, so readers for each source only
describe how one decoded object becomes one record (`parse(obj, loc)`), raising `DataError` via
`Location.error` / `require` when the object is wrong.

`PromptRecord` is what the RL trainer consumes: the chat messages to render (see
`megatron_rl.data.prompts.format_prompt`), the gold answer set (plus rare alternative accepted sets,
e.g. IgakuQA 112B30 accepts a or d), the choices and free-form metadata (exam, year, category,
kinki = prohibited choices, ...). `SFTRecord` is an expert (prompt, response) pair for CHORD.
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

OnMalformed = Literal["error", "skip"]
ON_MALFORMED_CHOICES: tuple[str, ...] = ("error", "skip")
MESSAGE_ROLES: frozenset[str] = frozenset({"system", "user", "assistant"})
# Skip mode keeps the first few problems verbatim so a summary can show what was dropped without
# holding a million messages for a badly broken file.
MAX_KEPT_PROBLEMS = 20

T = TypeVar("T")


class DataError(ValueError):
    """A malformed input: the message names the file, the line (when known) and the problem."""

    def __init__(self, problem: str, path: str | os.PathLike[str] | None = None,
                 line: int | None = None) -> None:
        self.problem = problem
        self.path = None if path is None else str(path)
        self.line = line
        where = self.path or ""
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(f"{where}: {problem}" if where else problem)


@dataclass(frozen=True)
class Location:
    """Where a decoded object came from; used to build `DataError`s."""

    path: str
    line: int | None = None

    def error(self, problem: str) -> DataError:
        return DataError(problem, self.path, self.line)


@dataclass
class ReadStats:
    """Counts for one file read with `read_jsonl` (records kept, malformed lines skipped)."""

    path: str
    records: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)

    def note_skipped(self, err: DataError) -> None:
        self.skipped += 1
        if len(self.problems) < MAX_KEPT_PROBLEMS:
            self.problems.append(str(err))

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "records": self.records, "skipped": self.skipped,
                "problems": list(self.problems)}


def normalize_answer_token(token: str) -> str:
    """Canonical form of one answer token: NFKC (full-width → ASCII), trimmed, lower case.

    Shared by the gold readers and the response parser so that gold "Ａ" and a response's "a"
    compare equal.
    """
    return unicodedata.normalize("NFKC", token).strip().lower()


def check_on_malformed(value: str) -> OnMalformed:
    if value not in ON_MALFORMED_CHOICES:
        raise ValueError(f"on_malformed must be one of {ON_MALFORMED_CHOICES}, got {value!r}")
    return value  # type: ignore[return-value]


def _type_name(types: type | tuple[type, ...]) -> str:
    if isinstance(types, tuple):
        return " or ".join(t.__name__ for t in types)
    return types.__name__


def require(obj: Mapping[str, Any], key: str, types: type | tuple[type, ...],
            loc: Location) -> Any:
    """`obj[key]`, checked to exist and to be an instance of `types` (bool is not an int here)."""
    if key not in obj:
        raise loc.error(f"missing key {key!r}")
    value = obj[key]
    wanted = types if isinstance(types, tuple) else (types,)
    bad_bool = isinstance(value, bool) and bool not in wanted
    if bad_bool or not isinstance(value, wanted):
        raise loc.error(f"key {key!r} must be {_type_name(types)}, got {type(value).__name__}")
    return value


def require_str_list(obj: Mapping[str, Any], key: str, loc: Location,
                     *, non_empty: bool = False) -> list[str]:
    values = require(obj, key, list, loc)
    for i, item in enumerate(values):
        if not isinstance(item, str):
            raise loc.error(f"key {key!r}[{i}] must be str, got {type(item).__name__}")
    if non_empty and not values:
        raise loc.error(f"key {key!r} must not be empty")
    return values


def optional(obj: Mapping[str, Any], key: str, types: type | tuple[type, ...], loc: Location,
             default: Any) -> Any:
    return require(obj, key, types, loc) if key in obj else default


def _decode_line(raw: bytes, loc: Location) -> dict[str, Any] | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise loc.error(f"not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise loc.error(f"bad JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise loc.error(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def read_jsonl(path: str | os.PathLike[str], parse: Callable[[dict[str, Any], Location], T],
               *, on_malformed: str = "error", stats: ReadStats | None = None) -> Iterator[T]:
    """Yield `parse(obj, loc)` for each non-blank line of a JSONL file.

    A line that is not UTF-8, not JSON, not an object, or that `parse` rejects with `DataError`
    raises that error (naming path and line) or, with `on_malformed="skip"`, is counted in
    `stats.skipped` and dropped. Blank lines are ignored (trailing newlines are common).
    """
    policy = check_on_malformed(on_malformed)
    stats = stats if stats is not None else ReadStats(str(path))
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            loc = Location(str(path), lineno)
            try:
                obj = _decode_line(raw, loc)
                if obj is None:
                    continue
                record = parse(obj, loc)
            except DataError as err:
                if policy == "error":
                    raise
                stats.note_skipped(err)
                continue
            stats.records += 1
            yield record


def write_jsonl(path: str | os.PathLike[str], records: Iterable[Any]) -> int:
    """Write records (mappings or objects with `to_dict()`) as UTF-8 JSONL; returns the count.

    Written to a temporary sibling and renamed, so a crash never leaves a half-written file that a
    later run would read as truncated data.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            obj = record.to_dict() if hasattr(record, "to_dict") else dict(record)
            handle.write(json.dumps(obj, ensure_ascii=False, sort_keys=True))
            handle.write("\n")
            count += 1
    os.replace(tmp, target)
    return count


def _parse_messages(obj: Mapping[str, Any], loc: Location) -> list[dict[str, str]]:
    raw = require(obj, "messages", list, loc)
    if not raw:
        raise loc.error("key 'messages' must not be empty")
    messages: list[dict[str, str]] = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise loc.error(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = require(msg, "role", str, loc)
        if role not in MESSAGE_ROLES:
            raise loc.error(f"messages[{i}].role must be one of {sorted(MESSAGE_ROLES)}, "
                            f"got {role!r}")
        messages.append({"role": role, "content": require(msg, "content", str, loc)})
    return messages


@dataclass
class PromptRecord:
    """One RL prompt: chat messages, gold answer set(s), choices and metadata.

    A response is correct when its answer set equals `answer` or one of `alternatives` (nearly
    always empty). `metadata` carries source-specific fields; the rewards read `metadata["kinki"]`
    (prohibited choice letters) from it.
    """

    id: str
    source: str
    messages: list[dict[str, str]]
    answer: list[str]
    choices: list[str] = field(default_factory=list)
    alternatives: list[list[str]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    def accepted_sets(self) -> list[frozenset[str]]:
        return [frozenset(self.answer), *(frozenset(alt) for alt in self.alternatives)]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "messages": self.messages,
                "answer": self.answer, "choices": self.choices,
                "alternatives": self.alternatives, "metadata": self.metadata}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], loc: Location) -> PromptRecord:
        alternatives = optional(obj, "alternatives", list, loc, [])
        for i, alt in enumerate(alternatives):
            if not isinstance(alt, list) or not all(isinstance(a, str) for a in alt):
                raise loc.error(f"alternatives[{i}] must be a list of str")
        return cls(
            id=require(obj, "id", str, loc),
            source=require(obj, "source", str, loc),
            messages=_parse_messages(obj, loc),
            answer=require_str_list(obj, "answer", loc, non_empty=True),
            choices=require_str_list(obj, "choices", loc) if "choices" in obj else [],
            alternatives=alternatives,
            metadata=optional(obj, "metadata", dict, loc, {}),
        )


@dataclass
class SFTRecord:
    """An expert (prompt messages, response) pair, e.g. the CHORD off-policy expert data."""

    id: str
    source: str
    messages: list[dict[str, str]]
    response: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "messages": self.messages,
                "response": self.response, "metadata": self.metadata}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], loc: Location) -> SFTRecord:
        response = require(obj, "response", str, loc)
        if not response.strip():
            raise loc.error("key 'response' must not be empty")
        return cls(
            id=require(obj, "id", str, loc),
            source=require(obj, "source", str, loc),
            messages=_parse_messages(obj, loc),
            response=response,
            metadata=optional(obj, "metadata", dict, loc, {}),
        )


def read_prompts(path: str | os.PathLike[str], *, on_malformed: str = "error",
                 stats: ReadStats | None = None) -> list[PromptRecord]:
    return list(read_jsonl(path, PromptRecord.from_dict, on_malformed=on_malformed, stats=stats))


def read_sft(path: str | os.PathLike[str], *, on_malformed: str = "error",
             stats: ReadStats | None = None) -> list[SFTRecord]:
    return list(read_jsonl(path, SFTRecord.from_dict, on_malformed=on_malformed, stats=stats))
