"""`rollout.chat_template_kwargs` reaches every prompt the project renders: training and eval prompts,
CHORD's expert prompts, the dry run's length check (and `eval generate`: test_eval_generate.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_rl.config import load_recipe
from megatron_rl.data.prompts import format_prompt, prompt_token_ids
from megatron_rl.data.schema import PromptRecord, SFTRecord, write_jsonl
from megatron_rl.demo.prepare import TOKENIZER_FILES
from megatron_rl.tasks import resolve_task
from tests.helpers.chat_templates import HYBRID
from tests.helpers.rollout import REPO, unit_assets

OFF = {"enable_thinking": False}
EMPTY_BLOCK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def hybrid_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo tokenizer with a Qwen3-hybrid-shaped template (enable_thinking false → an empty block)."""
    out = tmp_path_factory.mktemp("hybrid")
    src = unit_assets()["model"]
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = HYBRID
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


def _tokenizer(path: Path):  # noqa: ANN202
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


MESSAGES = [{"role": "user", "content": "Which vitamin? [ans]a[/ans]"}]


def test_prompt_rendering_takes_the_template_variables(hybrid_tokenizer: Path) -> None:
    tok = _tokenizer(hybrid_tokenizer)
    assert format_prompt(MESSAGES, tok, OFF).endswith("<|im_start|>assistant\n" + EMPTY_BLOCK)
    assert format_prompt(MESSAGES, tok).endswith("<|im_start|>assistant\n")
    on, off = prompt_token_ids(tok, MESSAGES), prompt_token_ids(tok, MESSAGES, OFF)
    assert off[:len(on)] == on and tok.decode(off[len(on):]) == EMPTY_BLOCK


def test_training_eval_and_sft_prompts_get_the_recipe_s_variables(hybrid_tokenizer: Path, tmp_path: Path) -> None:
    from megatron_rl.train.data import load_eval_set, load_prompts, load_sft_tokens

    tok = _tokenizer(hybrid_tokenizer)
    prompts = tmp_path / "p.jsonl"
    write_jsonl(prompts, [PromptRecord(id="1", source="mcq", answer=["a"], messages=MESSAGES)])
    sft = tmp_path / "s.jsonl"
    write_jsonl(sft, [SFTRecord(id="1", source="mcq", messages=MESSAGES, response="[ans]a[/ans]")])
    expected = prompt_token_ids(tok, MESSAGES, OFF)
    cfg = load_recipe(REPO / "recipes/tiny/grpo.yaml", [f"data.eval_path={prompts}", f"data.train_path={prompts}",
                                                         "rollout.chat_template_kwargs={enable_thinking: false}",
                                                         "rollout.max_prompt_length=512"])
    task = resolve_task(cfg.task, cfg.rewards.weights)
    train = load_prompts(str(prompts), tok, 512, "error", task.task.prompt, cfg.rollout.chat_template_kwargs)
    assert train.token_ids == [expected]
    evaluation = load_eval_set(cfg, tok, task)
    assert evaluation is not None and evaluation.token_ids == [expected]
    (row,) = load_sft_tokens(str(sft), tok, "error", cfg.rollout.chat_template_kwargs)
    assert row[0] == len(expected) and row[1:1 + len(expected)] == expected


def test_the_dry_run_measures_prompts_with_the_variables(hybrid_tokenizer: Path, tmp_path: Path) -> None:
    from megatron_rl.preflight import data_findings

    tok = _tokenizer(hybrid_tokenizer)
    prompts = tmp_path / "p.jsonl"
    write_jsonl(prompts, [PromptRecord(id=str(i), source="mcq", answer=["a"], messages=MESSAGES) for i in range(40)])
    n_on, n_off = len(prompt_token_ids(tok, MESSAGES)), len(prompt_token_ids(tok, MESSAGES, OFF))
    assert n_off > n_on
    base = [f"data.train_path={prompts}", f"model.tokenizer={hybrid_tokenizer}", f"rollout.max_prompt_length={n_on}"]
    assert data_findings(load_recipe(REPO / "recipes/tiny/grpo.yaml", [*base, "data.eval_path=null",
                                                                        "evaluation.interval=0"])) == []
    off = load_recipe(REPO / "recipes/tiny/grpo.yaml", [*base, "data.eval_path=null", "evaluation.interval=0",
                                                         "rollout.chat_template_kwargs={enable_thinking: false}"])
    (finding,) = data_findings(off)
    assert finding.level == "error" and f"0 of 40 prompts fit rollout.max_prompt_length={n_on}" in finding.message
