"""MedMCQA answer rewards (single answer, options a–d): `medmcqa_strict` and `medmcqa_flexible`.

Both look only at the response tail (`rewards.registry.MAX_TAIL_CHARS`), NFKC-normalised so full-width
text matches, and try answer patterns in priority order; the first pattern that matches decides,
using its LAST match in the tail:

  strict (explicit answer statements only)
    1. `[ans]X[/ans]`                      (the project's format; parsed by `mcq.answer.extract_answer`)
    2. `The correct answer/option is X`
    3. `Answer: X` / `Final answer: X`      (colon required)
    4. `答え: X`, `答えはX`, `正解: X`, `正解はX`
  flexible = strict, then looser phrasings
    5. `The answer is X`, `answer X`
    6. `option X`, `choice X`
    7. a last line that is only the letter: `X`, `(X)`, `X.`, `X)`

Because "a" is also an English word, a letter counts only when it is upper case (`B`), in
parentheses (`(b)`), or lower case followed by `) . : , ;` or the end of the line — so
"the answer is a fracture" yields no answer, while "Answer: b" does.

Reward: correct → 1.0; an answer was found but is wrong (or names several options) → 0.1, a small
format credit; no answer → 0.0.

All patterns use only bounded quantifiers (`{0,4}`), so matching cannot backtrack
catastrophically, and the input is the bounded tail.

Not the published MedMCQA reward (the Qwen3-235B GSPO attempt, ms-swift plugin), on purpose. That
reward's strict mode looks at the last 300 characters, tries ten case-insensitive patterns
("答え:", "Answer:", "正解:", "The correct answer is", "X is the correct answer", "選択肢X",
"Therefore, X", "So, X", "最終的な答えは", "Final answer:") with unbounded `\\s*`, and its flexible
mode is the last standalone capital A–D. It reads "Answer: a patient…" as A, "…is also a cause…"
as A ("so a" inside "also a"), and prefers an earlier "答え:" over a later "Answer:". Its scores
(1.0 / 0.1 / 0.0) are the ones used here. Beyond the extractor it had three defects, so its reward
curve cannot be compared with this one:
- label offset: the Hugging Face copy of MedMCQA stores `cop` 0–3, the reward mapped 1–4 to A–D,
  so every gold letter was shifted and answer "a" could never score (here `data prepare medmcqa`
  detects the copy's base, `detect_cop_base` in `data.py`, and reads it correctly; `--cop-base`
  overrides it);
- gold by batch position: it took the i-th gold of the dataset for the i-th completion of a
  batch (no `indices` kwarg is passed by ms-swift), not the completion's own question (here each
  reward call receives its own sample);
- the options were not in the prompt (only `question` is mapped to the query), while the system
  prompt asked for A–D (here the prompt lists them, `data.py`).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import Any

from ...rewards.registry import register_reward, tail
from ..mcq.answer import extract_answer, gold_sets

CORRECT_REWARD = 1.0
FORMATTED_WRONG_REWARD = 0.1
NO_ANSWER_REWARD = 0.0

_SP = r"[ \t]{0,4}"


def _letter(last: str) -> str:
    lo, up = f"a-{last}", f"A-{last.upper()}"
    return (rf"(?:\((?P<paren>[{lo}{up}])\)"
            rf"|(?P<upper>[{up}])(?![A-Za-z0-9])"
            rf"|(?P<lower>[{lo}])(?=[).:,;]|[ \t]{{0,4}}(?:\n|$)))")


@functools.lru_cache(maxsize=32)
def _patterns(last: str) -> tuple[tuple[re.Pattern[str], ...], tuple[re.Pattern[str], ...]]:
    """(strict, flexible-only) patterns for options a..`last`."""
    letter = _letter(last)
    strict = (
        re.compile(rf"(?i:the){_SP}(?i:correct){_SP}(?i:answer|option){_SP}(?i:is){_SP}:?{_SP}" + letter),
        re.compile(rf"(?i:answer){_SP}:{_SP}" + letter),
        re.compile(rf"(?:答え|正解|解答){_SP}(?::|は){_SP}" + letter),
    )
    flexible = (
        re.compile(rf"(?i:answer){_SP}(?:(?i:is){_SP})?" + letter),
        re.compile(rf"(?i:option|choice){_SP}" + letter),
        re.compile(rf"(?:^|\n)[ \t]{{0,4}}{letter}[ \t]{{0,4}}$"),
    )
    return strict, flexible


def _letter_of(match: re.Match[str]) -> str:
    letter = match.group("paren") or match.group("upper") or match.group("lower")
    return letter.lower()


def extract_medmcqa_answer(response: str, *, flexible: bool, last_letter: str = "d") -> frozenset[str] | None:
    """The answer set by the first matching pattern (see module docstring), or None. Options run
    a..`last_letter` (MedMCQA: d; MedXpertQA Text: j)."""
    if not ("a" <= last_letter <= "z" and len(last_letter) == 1):
        raise ValueError(f"last_letter must be one of a..z, got {last_letter!r}")
    tagged = extract_answer(response)
    if tagged is not None:
        return tagged
    window = unicodedata.normalize("NFKC", tail(response)).rstrip()
    strict, loose = _patterns(last_letter)
    patterns = strict + (loose if flexible else ())
    for pattern in patterns:
        last = None
        for match in pattern.finditer(window):
            last = match
        if last is not None:
            return frozenset({_letter_of(last)})
    return None


def _score(answer: frozenset[str] | None, sample: Any) -> float:
    if answer is None:
        return NO_ANSWER_REWARD
    return CORRECT_REWARD if answer in gold_sets(sample) else FORMATTED_WRONG_REWARD


@register_reward("medmcqa_strict")
def medmcqa_strict(response: str, sample: Any) -> float:
    return _score(extract_medmcqa_answer(response, flexible=False), sample)


@register_reward("medmcqa_flexible")
def medmcqa_flexible(response: str, sample: Any) -> float:
    return _score(extract_medmcqa_answer(response, flexible=True), sample)
