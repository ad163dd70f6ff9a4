"""Rendering chat messages for generation: the one path every prompt the model sees takes.

`format_prompt` renders messages with the model's chat template when a tokenizer is given
(`apply_chat_template(..., add_generation_prompt=True, tokenize=False)`), else with the plain
fallback template below, which exists for tests and for base models without a chat template:

    ### System:
    <system content>

    ### User:
    <user content>

    ### Assistant:
    <- generation starts here

What the messages say is the task's business (e.g. `megatron_rl.tasks.mcq.prompts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

FALLBACK_ROLE_HEADERS: dict[str, str] = {
    "system": "### System:", "user": "### User:", "assistant": "### Assistant:",
}


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
