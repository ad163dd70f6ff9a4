"""Prompt construction: chat messages that ask for the `[ans]…[/ans]` answer format.

`build_messages` returns OpenAI-style messages (system + user). `format_prompt` renders them with
the model's chat template when a tokenizer is given (`apply_chat_template(...,
add_generation_prompt=True, tokenize=False)`), else with the plain fallback template below, which
exists for tests and for base models without a chat template:

    ### System:
    <system content>

    ### User:
    <user content>

    ### Assistant:
    <- generation starts here

The instruction always mentions the multi-answer form, whatever the question, so the prompt never
leaks how many answers are correct (the question text itself says "2つ選べ" when it matters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from megatron_rl.rewards.mcq import format_answer

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
HEADINGS: dict[str, tuple[str, str]] = {"ja": ("問題", "選択肢"), "en": ("Question", "Options")}
FALLBACK_ROLE_HEADERS: dict[str, str] = {
    "system": "### System:", "user": "### User:", "assistant": "### Assistant:",
}


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


def article000_messages(question: str, choices: Sequence[str]) -> list[dict[str, str]]:
    """Article 000's prompt: its system message verbatim; the user message is the question and,
    unlike the article's run (ms-swift mapped only `question` to the query), the options it asks
    about, lettered A–D as its system message names them. No [ans] instruction: the system
    message sets the answer format, which `medmcqa_strict` reads."""
    lines = [question.strip(), ""]
    lines.extend(f"{choice_letter(i).upper()}. {choice.strip()}" for i, choice in enumerate(choices))
    return [{"role": "system", "content": ARTICLE_000_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def sft_target(answer: Sequence[str]) -> str:
    """The templated expert response for data without written explanations: "[ans]a,c[/ans]"."""
    return format_answer(answer)


def prompt_token_ids(tokenizer: Any, messages: Sequence[dict[str, str]],
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The token ids of a generation prompt: the chat template over `messages`, with the recipe's
    `rollout.chat_template_kwargs` (e.g. enable_thinking). Every prompt the project renders for
    the model goes through here (training, evaluation, CHORD's expert prompts, the dry run,
    `eval generate`), so a template variable set in the recipe reaches all of them."""
    rendered = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                             return_dict=True, **dict(chat_template_kwargs or {}))
    return list(rendered["input_ids"])


def format_prompt(messages: Sequence[dict[str, str]], tokenizer: Any = None,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """Render messages for generation (chat template if `tokenizer`, else the fallback)."""
    if tokenizer is not None:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                             tokenize=False, **dict(chat_template_kwargs or {}))
    parts = []
    for message in messages:
        role = message["role"]
        if role not in FALLBACK_ROLE_HEADERS:
            raise ValueError(f"unknown message role {role!r}")
        parts.append(f"{FALLBACK_ROLE_HEADERS[role]}\n{message['content']}\n\n")
    parts.append(f"{FALLBACK_ROLE_HEADERS['assistant']}\n")
    return "".join(parts)
