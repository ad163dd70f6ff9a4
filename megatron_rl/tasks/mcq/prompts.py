"""MCQ prompts: chat messages that ask for the `[ans]…[/ans]` answer format (`answer.py` reads it).

`build_messages` returns OpenAI-style messages (system + user); `megatron_rl.data.prompts`
renders them for generation. The instruction always mentions the multi-answer form, whatever the
question, so the prompt never leaks how many answers are correct (the question text itself says
"2つ選べ" when it matters).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from .answer import format_answer

Language = Literal["ja", "en"]

SYSTEM_PROMPT: dict[str, str] = {
    "ja": "あなたは医学に精通した医師です。日本語で簡潔に考え、正確に回答してください。",
    "en": "You are an experienced physician. Reason briefly and answer accurately.",
}
CHOICE_INSTRUCTION: dict[str, str] = {
    "ja": ("回答は最後に[ans]a[/ans]の形式で記載してください。"
           "複数選ぶ場合は[ans]a,c[/ans]のようにカンマで区切ってください。"),
    "en": ("Give your final answer at the end in the form [ans]a[/ans]. "
           "If several options are correct, separate them with commas, e.g. [ans]a,c[/ans]."),
}
NUMERIC_INSTRUCTION: dict[str, str] = {
    "ja": "回答は最後に[ans]26[/ans]のように数値で記載してください。",
    "en": "Give your final numeric answer at the end in the form [ans]26[/ans].",
}
HEADINGS: dict[str, tuple[str, str]] = {"ja": ("問題", "選択肢"), "en": ("Question", "Options")}


def choice_letter(index: int) -> str:
    if not 0 <= index < 26:
        raise ValueError(f"choice index {index} out of range a–z")
    return chr(ord("a") + index)


def render_question(question: str, choices: Sequence[str], language: Language = "ja") -> str:
    """The user message body: question, lettered choices and the answer-format instruction."""
    if language not in HEADINGS:
        raise ValueError(f"language must be one of {sorted(HEADINGS)}, got {language!r}")
    q_head, c_head = HEADINGS[language]
    lines = [f"{q_head}: {question.strip()}"]
    if choices:
        lines.append(f"{c_head}:")
        lines.extend(f"{choice_letter(i)}. {choice.strip()}" for i, choice in enumerate(choices))
        lines.append("")
        lines.append(CHOICE_INSTRUCTION[language])
    else:
        lines.append("")
        lines.append(NUMERIC_INSTRUCTION[language])
    return "\n".join(lines)


def build_messages(question: str, choices: Sequence[str], *, language: Language = "ja",
                   system_prompt: str | None = None) -> list[dict[str, str]]:
    """System + user messages; `system_prompt=""` leaves the system message out."""
    system = SYSTEM_PROMPT[language] if system_prompt is None else system_prompt
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": render_question(question, choices, language)})
    return messages


def sft_target(answer: Sequence[str]) -> str:
    """The templated expert response for data without written explanations: "[ans]a,c[/ans]"."""
    return format_answer(answer)
