"""`megatron-rl data ...` and `megatron-rl eval ...` through the CLI (`megatron_rl.cli.main`),
in-process and once as a subprocess (a fresh interpreter: checks that these verbs never import
torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_rl import cli
from tests.helpers.igakuqa import (
    FIXTURE,
    FIXTURE_BASELINES,
    REAL_BASELINES,
    REAL_DIR,
    REPO_ROOT,
    needs_real_igakuqa,
)

Runner = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Runner:
    def invoke(*argv: object) -> tuple[int, str, str]:
        rc = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return invoke


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


def test_data_prepare_igakuqa(run: Runner, tmp_path: Path) -> None:
    rc, out, err = run("data", "prepare", "igakuqa", "--src", FIXTURE, "--out", tmp_path,
                       "--years", "2018", "--eval-years", "2022")
    assert rc == 0, err
    for name in ("igakuqa_train", "igakuqa_eval", "igakuqa_sft"):
        path = tmp_path / f"{name}.jsonl"
        n_lines = len(path.read_text(encoding="utf-8").splitlines())
        assert f"{path}: {n_lines} records" in out
    train = [json.loads(line) for line in
             (tmp_path / "igakuqa_train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {r["metadata"]["year"] for r in train} == {2018}
    assert "excluded from training" in out


def write_block(root: Path, lines: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    good = {"problem_id": "112A1", "problem_text": "問", "choices": ["x", "y"], "answer": ["a"],
            "points": "1", "text_only": True}
    content = [json.dumps(good)] + lines
    (root / "112-A.jsonl").write_text("\n".join(content) + "\n", encoding="utf-8")
    return root


def test_data_prepare_malformed_line_error_and_skip(run: Runner, tmp_path: Path) -> None:
    src = write_block(tmp_path / "src", ['{"problem_id": "112A2", "choices": [],',
                                         json.dumps({"problem_id": "112A3", "answer": ["a"]})])
    rc, out, err = run("data", "prepare", "igakuqa", "--src", src, "--out", tmp_path / "o",
                       "--years", "", "--eval-years", "2018")
    assert rc == 1 and out == ""
    line = one_error_line(err)
    assert "112-A.jsonl:2: bad JSON" in line

    rc, out, err = run("data", "prepare", "igakuqa", "--src", src, "--out", tmp_path / "o",
                       "--years", "", "--eval-years", "2018", "--on-malformed", "skip")
    assert rc == 0, err
    assert "skipped 2 malformed lines" in out
    summary = json.loads((tmp_path / "o" / "igakuqa_prepare.json").read_text(encoding="utf-8"))
    assert summary["skipped_lines"] == 2
    assert summary["counts"]["igakuqa_eval"] == 1


def test_data_prepare_medmcqa(run: Runner, tmp_path: Path) -> None:
    rows = [{"id": "m1", "question": "Q?", "opa": "a", "opb": "b", "opc": "c", "opd": "d",
             "cop": 3, "exp": "Because."}]
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    rc, out, err = run("data", "prepare", "medmcqa", "--src", src, "--out", tmp_path / "o", "--cop-base", "1")
    assert rc == 0, err
    prompt = json.loads((tmp_path / "o" / "medmcqa_train.jsonl").read_text(encoding="utf-8"))
    assert prompt["answer"] == ["c"] and prompt["source"] == "medmcqa"
    rc, _, err = run("data", "prepare", "medmcqa", "--src", tmp_path / "missing.jsonl",
                     "--out", tmp_path / "o")
    assert rc == 1 and "missing.jsonl" in one_error_line(err)


def test_bad_year_is_a_usage_error(run: Runner, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        run("data", "prepare", "igakuqa", "--src", FIXTURE, "--out", tmp_path,
            "--years", "18")
    assert info.value.code == 2


def test_eval_igakuqa_markdown_and_json(run: Runner) -> None:
    rc, out, err = run("eval", "igakuqa", "--pred", FIXTURE_BASELINES, "--gold", FIXTURE,
                       "--system", "alpha")
    assert rc == 0, err
    assert out.startswith("## IgakuQA: alpha")
    assert "Scoring rule: official:" in out
    assert "### By year" in out and "| 2022 | 116 |" in out
    rc, out, err = run("eval", "igakuqa", "--pred", FIXTURE_BASELINES / "2022", "--gold",
                       FIXTURE, "--system", "alpha", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert (report["system"], report["rule"]) == ("alpha", "official")
    assert report["overall"]["n"] == 6
    assert [y["year"] for y in report["by_year"]] == [2022]
    # alpha writes "a, b" for 116A2: wrong for the benchmark's script, right as a letter set.
    official = report["overall"]["correct"]
    rc, out, err = run("eval", "igakuqa", "--pred", FIXTURE_BASELINES / "2022", "--gold",
                       FIXTURE, "--system", "alpha", "--json", "--rule", "letter-set")
    assert rc == 0, err
    lenient = json.loads(out)
    assert lenient["rule"] == "letter-set" and lenient["overall"]["correct"] == official + 1


@needs_real_igakuqa
def test_eval_igakuqa_on_the_real_benchmark(run: Runner) -> None:
    rc, out, err = run("eval", "igakuqa", "--pred", REAL_BASELINES, "--gold", REAL_DIR,
                       "--system", "gpt4")
    assert rc == 0, err
    assert "| 2022 | 116 |" in out and "PASS" in out


def test_eval_igakuqa_bad_input(run: Runner, tmp_path: Path) -> None:
    pred = tmp_path / "116-A_mine.jsonl"
    pred.write_text('{"problem_id": "116A1", "prediction": "a"}\n{"problem_id": 5}\n',
                    encoding="utf-8")
    rc, out, err = run("eval", "igakuqa", "--pred", pred, "--gold", FIXTURE)
    assert rc == 1 and out == ""
    assert "116-A_mine.jsonl:2: key 'problem_id' must be str, got int" in one_error_line(err)
    rc, _, err = run("eval", "igakuqa", "--pred", FIXTURE_BASELINES, "--gold", FIXTURE)
    assert rc == 1 and "--system" in one_error_line(err)
    with pytest.raises(SystemExit) as info:
        run("eval", "igakuqa", "--pred", FIXTURE_BASELINES, "--gold", FIXTURE, "--rule", "loose")
    assert info.value.code == 2


def test_eval_compare_writes_tables_json_and_png(run: Runner, tmp_path: Path) -> None:
    rc, out, err = run("eval", "compare", FIXTURE_BASELINES, FIXTURE_BASELINES, "--gold",
                       FIXTURE, "--system-a", "beta", "--system-b", "alpha", "--out", tmp_path)
    assert rc == 0, err
    assert out.startswith("## IgakuQA: alpha (B) vs beta (A)")
    assert (tmp_path / "compare.md").read_text(encoding="utf-8") == out
    comparison = json.loads((tmp_path / "compare.json").read_text(encoding="utf-8"))
    assert comparison["overall"]["n"] == 20 and comparison["rule"] == "official"
    assert (tmp_path / "category_delta.png").read_bytes()[:4] == b"\x89PNG"
    rc, out, _ = run("eval", "compare", FIXTURE_BASELINES / "2018", FIXTURE_BASELINES / "2018",
                     "--gold", FIXTURE, "--system-a", "alpha", "--system-b", "alpha", "--json")
    assert rc == 0
    same = json.loads(out)["overall"]
    assert (same["n"], same["b"], same["c"], same["p_value"]) == (14, 0, 0, 1.0)


def test_eval_compare_errors(run: Runner, tmp_path: Path) -> None:
    rc, _, err = run("eval", "compare", FIXTURE_BASELINES, FIXTURE_BASELINES, "--gold", FIXTURE,
                     "--system-a", "alpha", "--system-b", "nosuch")
    assert rc == 1 and "no files for system 'nosuch'" in one_error_line(err)
    rc, _, err = run("eval", "compare", FIXTURE_BASELINES / "2018", FIXTURE_BASELINES / "2022",
                     "--gold", FIXTURE, "--system-a", "alpha", "--system-b", "alpha")
    assert rc == 1 and "share no IgakuQA exam block" in one_error_line(err)


def test_cli_in_a_fresh_interpreter_does_not_import_torch() -> None:
    # Runs the real entry point (`python -m megatron_rl.cli`, every verb registered) and reports
    # afterwards whether anything imported torch.
    script = (
        "import json, runpy, sys\n"
        "sys.argv = ['megatron-rl', *sys.argv[1:]]\n"
        "try:\n"
        "    runpy.run_module('megatron_rl.cli', run_name='__main__', alter_sys=True)\n"
        "    code = 0\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "print(json.dumps({'rc': code, 'torch': 'torch' in sys.modules}), file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, "eval", "igakuqa", "--pred",
         str(FIXTURE_BASELINES / "2018"), "--gold", str(FIXTURE), "--system", "gamma", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    status = json.loads(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0 and status == {"rc": 0, "torch": False}, proc.stderr
    assert json.loads(proc.stdout)["overall"]["n"] == 14
