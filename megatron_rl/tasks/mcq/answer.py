"""Multiple-choice rewards and THE `[ans]…[/ans]` parser (evaluation reuses it; do not copy it).

Answer format (what `prompts.py` asks for): the response ends with
`[ans]a[/ans]`, or `[ans]a,c[/ans]` for multi-answer questions, or `[ans]26[/ans]` for the few
numeric IgakuQA questions.

Parsing rules (`extract_answer`):
- only the last `MAX_TAIL_CHARS` characters are looked at (see `rewards.registry.MAX_TAIL_CHARS`);
- the tail is NFKC-normalised and lower-cased first, so full-width
  `［ａｎｓ］Ａ、Ｃ［／ａｎｓ］` and upper-case `[ANS]A[/ANS]` parse like `[ans]a,c[/ans]`;
- the LAST complete `[ans]…[/ans]` pair wins (models often restate a draft answer first);
- its content is split on commas, `、`, `・`, `/`, `;` and whitespace; surrounding brackets and
  periods are dropped from each token; every token must be one letter a–z or a plain number,
  otherwise there is no answer (`[ans]ac[/ans]` and `[ans]a or c[/ans]` do not parse: a guess at
  what they mean would reward sloppy formatting).

No regular expressions are used here, only `str.rfind`/`split`, so the cost is linear in the
(bounded) tail whatever the response contains.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from ...data.schema import normalize_answer_token
from ...rewards.registry import register_reward, sample_field, tail

OPEN_TAG = "[ans]"
CLOSE_TAG = "[/ans]"
# Longer tag contents are not answers (a 5-choice answer is at most "a,b,c,d,e"); refusing them
# early also keeps NFKC/split work on hostile content bounded.
MAX_ANSWER_CHARS = 128
DEFAULT_PROHIBITED_PENALTY = -1.0

_SEPARATORS = str.maketrans({",": " ", "、": " ", "・": " ", "/": " ", ";": " ", "&": " "})
_TOKEN_STRIP = "()[]{}<>「」『』【】.。:'\"`*"
_DIGITS = frozenset("0123456789")


def _is_number(token: str) -> bool:
    whole, _, frac = token.partition(".")
    return bool(whole) and set(whole) <= _DIGITS and set(frac) <= _DIGITS


def _is_valid_token(token: str) -> bool:
    return (len(token) == 1 and "a" <= token <= "z") or _is_number(token)


def parse_choice_set(content: str) -> frozenset[str] | None:
    """The answer set written in `content` (e.g. "a, c" → {"a", "c"}), or None if unparseable."""
    if len(content) > MAX_ANSWER_CHARS:
        return None
    normalized = normalize_answer_token(content).translate(_SEPARATORS)
    tokens: set[str] = set()
    for raw in normalized.split():
        token = raw.strip(_TOKEN_STRIP)
        if not token:
            continue
        if not _is_valid_token(token):
            return None
        tokens.add(token)
    return frozenset(tokens) if tokens else None


def extract_answer(response: str) -> frozenset[str] | None:
    """The answer set in the last `[ans]…[/ans]` of the response tail, or None."""
    window = unicodedata.normalize("NFKC", tail(response)).lower()
    end = window.rfind(CLOSE_TAG)
    if end < 0:
        return None
    start = window.rfind(OPEN_TAG, 0, end)
    if start < 0:
        return None
    return parse_choice_set(window[start + len(OPEN_TAG):end])


def format_answer(letters: Any) -> str:
    """The canonical answer tag for a set of letters: {"c", "a"} → "[ans]a,c[/ans]"."""
    return f"{OPEN_TAG}{','.join(sorted(letters))}{CLOSE_TAG}"


def _as_answer_set(value: Any) -> frozenset[str] | None:
    if isinstance(value, str):
        return parse_choice_set(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        tokens = frozenset(normalize_answer_token(str(v)) for v in value)
        return tokens if tokens and "" not in tokens else None
    return None


def gold_sets(sample: Any) -> list[frozenset[str]]:
    """Accepted answer sets of a sample: its `answer` plus any `alternatives`."""
    gold = _as_answer_set(sample_field(sample, "answer"))
    if gold is None:
        raise ValueError("sample has no usable 'answer' (a non-empty list of choice letters)")
    accepted = [gold]
    for alt in sample_field(sample, "alternatives", None) or []:
        alt_set = _as_answer_set(alt)
        if alt_set is not None:
            accepted.append(alt_set)
    return accepted


def prohibited_letters(sample: Any) -> frozenset[str]:
    return _as_answer_set(sample_field(sample, "kinki", None) or []) or frozenset()


@register_reward("mcq_answer")
def mcq_answer(response: str, sample: Any) -> float:
    """1.0 when the last `[ans]` set equals an accepted gold set exactly, else 0.0."""
    answer = extract_answer(response)
    return 1.0 if answer is not None and answer in gold_sets(sample) else 0.0


@register_reward("prohibited_choice")
def prohibited_choice(response: str, sample: Any,
                      penalty: float = DEFAULT_PROHIBITED_PENALTY) -> float:
    """`penalty` when the chosen set contains a prohibited (kinki) choice, else 0.0.

    In the Japanese licensing exam choosing four or more prohibited choices fails the candidate
    regardless of score, so this is a separate, negative signal rather than part of correctness.
    """
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return penalty if answer & prohibited_letters(sample) else 0.0
