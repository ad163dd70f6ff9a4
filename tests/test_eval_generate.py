"""`eval generate` → `eval igakuqa`: predictions from a real rollout server, scored by the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.cli import main
from tests.rollout_fixtures import REPO, demo_assets

pytestmark = pytest.mark.slow
IGAKUQA = REPO.parent / "shared" / "data" / "igakuqa"


def test_generated_predictions_are_scored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    assert main(["data", "prepare", "igakuqa", "--src", str(IGAKUQA), "--out", str(data),
                 "--years", "2018", "--eval-years", "2022"]) == 0
    out = tmp_path / "pred.jsonl"
    assert main(["eval", "generate", "--model", str(demo_assets()["model"]), "--prompts",
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
