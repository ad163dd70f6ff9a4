"""Language-consistency reward: penalise responses that drift out of Japanese.

`japanese_only` splits the response on `。` and returns 0.0 as soon as two consecutive non-empty
sentences contain no kana letter; otherwise 1.0. Kana letters are hiragana ぁ–ゖ (U+3041–3096),
katakana ァ–ヺ (U+30A1–30FA) and ㇰ–ㇿ (U+31F0–31FF), and half-width ｦ–ｯ, ｱ–ﾝ (U+FF66–FF6F,
U+FF71–FF9D). Not counted: the long-vowel mark ー/ｰ, the middle dot ・/･, iteration marks
(ゝゞヽヾ) and (semi-)voiced sound marks: they appear in Chinese text too (维生素B・C, 胰岛素ー),
and a sentence whose only "kana" is one of them is not Japanese. One kana-free
sentence is tolerated because Japanese medical text legitimately has some (a lab value line, an
English drug name, the answer tag). Answer tags `[ans]…[/ans]` are removed before the check.

Known limits of the rule (kept as specified): a run of kanji-only sentences
(e.g. "診断：急性心筋梗塞。治療：PCI。") counts as non-Japanese, and a response with no `。` at all
is a single sentence, so an all-English response punctuated with "." scores 1.0.

Only the last `LANGUAGE_SCAN_CHARS` characters are checked (a larger window than the answer
parsers' because drift anywhere in a long chain of thought matters); the two regular expressions
are a single character class and a literal-bounded span, so each scan is linear and cannot
backtrack.
"""

from __future__ import annotations

import re
from typing import Any

from megatron_rl.rewards.registry import register_reward, tail

LANGUAGE_SCAN_CHARS = 16384
SENTENCE_END = "。"

_KANA = re.compile("[\u3041-\u3096\u30a1-\u30fa\u31f0-\u31ff\uff66-\uff6f\uff71-\uff9d]")
_ANSWER_SPAN = re.compile(r"\[ans\][^\[\]]{0,128}\[/ans\]", re.IGNORECASE)


@register_reward("japanese_only")
def japanese_only(response: str, sample: Any = None) -> float:
    text = _ANSWER_SPAN.sub(" ", tail(response, LANGUAGE_SCAN_CHARS))
    previous_without_kana = False
    for sentence in text.split(SENTENCE_END):
        if not sentence.strip():
            continue
        without_kana = _KANA.search(sentence) is None
        if without_kana and previous_without_kana:
            return 0.0
        previous_without_kana = without_kana
    return 1.0
