"""Does a checkpoint's chat template start the answer in a thinking block? (torch-free)

Three template families matter for the Qwen3 checkpoints the recipes use:
- Thinking-2507 (ms-swift's `qwen3_thinking`): the generation prompt ends in an open `<think>`;
- the hybrid releases (Qwen3-235B-A22B, Qwen3-30B-A3B, ...): the model opens `<think>` itself unless
  the template variable `enable_thinking` is false, which renders an empty, closed block;
- Instruct-2507 and Qwen3-Next-*-Instruct (`qwen3_nothinking`): no thinking at all.

`thinking_mode` renders a one-turn probe with the template itself (from `tokenizer_config.json` or
`chat_template.jinja`, with jinja2 as transformers does, without importing transformers or torch)
and the recipe's `rollout.chat_template_kwargs`; without a local tokenizer (cluster paths) it falls
back to the release's name. The lint's `thinking-budget` rule uses it: a thinking block of a
medical question does not end within a few hundred tokens, so a budget under
`MIN_THINKING_BUDGET` leaves most completions inside it, before any answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

Mode = Literal["opens", "model-decides", "closed", "none"]
THINKING_MODES: tuple[Mode, ...] = ("opens", "model-decides")
MIN_THINKING_BUDGET = 1024
OPEN, CLOSE = "<think>", "</think>"
_PROBE = "megatron-rl-thinking-probe"
# Hybrid (thinking-by-default) release names: Qwen3-<size>B[-A<size>B] with no -Instruct/-Thinking/-Base.
_HYBRID_NAME = re.compile(r"^Qwen3-\d+(?:\.\d+)?B(?:-A\d+(?:\.\d+)?B)?(?:-FP8|-AWQ|-GPTQ.*)?$", re.IGNORECASE)


def template_source(tokenizer_dir: str | Path) -> str | None:
    """The chat template of a tokenizer directory, or None when it has none (or is not local)."""
    d = Path(tokenizer_dir)
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = d / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):        # named templates: transformers uses "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def render_generation_prompt(source: str, kwargs: Mapping[str, Any]) -> str:
    """The template over one user turn with the generation prompt, rendered as transformers does
    (sandboxed jinja2, trim_blocks, lstrip_blocks, `raise_exception`)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    messages = [{"role": "user", "content": _PROBE}]
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, tools=None,
                                          bos_token="", eos_token="", **dict(kwargs))


def mode_of_rendering(text: str, source: str) -> Mode:
    """What the answer starts in, from the rendered generation prompt (the text after the probe)."""
    tail = text.rsplit(_PROBE, 1)[-1]
    if OPEN in tail:
        return "closed" if CLOSE in tail.rsplit(OPEN, 1)[-1] else "opens"
    return "model-decides" if "enable_thinking" in source else "none"


def mode_of_name(checkpoint: str, kwargs: Mapping[str, Any]) -> Mode | None:
    """From the release's directory name alone (None: no rule for it)."""
    name = Path(checkpoint.rstrip("/")).name
    if "thinking" in name.lower():
        return "opens"
    if _HYBRID_NAME.match(name):
        return "closed" if kwargs.get("enable_thinking") is False else "model-decides"
    if "instruct" in name.lower():
        return "none"
    return None


def thinking_mode(tokenizer_dir: str | None, kwargs: Mapping[str, Any]) -> tuple[Mode | None, str]:
    """(mode, how it was found): from the local template when there is one, else from the name."""
    source = template_source(tokenizer_dir) if tokenizer_dir else None
    if source is not None:
        try:
            return mode_of_rendering(render_generation_prompt(source, kwargs), source), "its chat template"
        except Exception:   # noqa: BLE001 -- a template jinja2 cannot render here: judge by its text
            return ("model-decides" if "enable_thinking" in source and kwargs.get("enable_thinking") is not False
                    else None), "its chat template's text"
    if tokenizer_dir is None:
        return None, "no tokenizer"
    return mode_of_name(tokenizer_dir, kwargs), "its name"
