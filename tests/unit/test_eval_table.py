"""`eval table`: several systems in the published layouts (years × All × text only, specialties
with the best method, McNemar with * / ** marks and exact p in the JSON), Markdown + PNG.

The p-values are checked against scipy's exact binomial test on a synthetic benchmark built so
that the marks land on both sides of both thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scipy.stats import binomtest

from megatron_rl import cli
from megatron_rl.data.schema import DataError
from megatron_rl.tasks.igakuqa.data import load_igakuqa
from megatron_rl.tasks.igakuqa.report import evaluate
from megatron_rl.tasks.igakuqa.scoring import load_predictions
from megatron_rl.tasks.igakuqa.stats import format_p, significance_mark
from megatron_rl.tasks.igakuqa.table import build_table, parse_system_spec, render_markdown
from tests.helpers.igakuqa import (
    FIXTURE,
    FIXTURE_BASELINES,
    REAL_BASELINES,
    REAL_DIR,
    needs_real_igakuqa,
)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("p, mark", [(1e-9, "**"), (0.0099, "**"), (0.01, "*"), (0.0499, "*"),
                                     (0.05, ""), (0.5, ""), (1.0, "")])
def test_marks_follow_the_thresholds(p: float, mark: str) -> None:
    assert significance_mark(p) == mark


@pytest.mark.parametrize("p, text", [(0.0013, "0.0013 **"), (0.0036, "0.0036 **"),
                                     (0.349, "0.349"), (0.775, "0.775"), (0.0312, "0.0312 *"),
                                     (1.0, "1")])
def test_p_values_print_as_published(p: float, text: str) -> None:
    assert format_p(p) == text


# --- a synthetic two-year benchmark and four systems with planned discordant pairs -----------

N_PER_BLOCK = 60
# Per system: how many baseline-wrong questions it gets right (c) and baseline-right ones it gets
# wrong (b), in each year: the exact p-values straddle 0.01 and 0.05.
PLAN = {"grpo": (20, 2), "gspo": (9, 3), "chord": (14, 3)}


def synthetic_benchmark(root: Path) -> tuple[Path, Path]:
    gold_dir, pred_dir = root / "gold", root / "pred"
    for exam in (117, 118):  # 2023, 2024
        year_dir = gold_dir / "data" / str(exam + 1906)
        year_dir.mkdir(parents=True)
        questions, meta, preds = [], [], {s: [] for s in ("base", *PLAN)}
        for i in range(1, N_PER_BLOCK + 1):
            pid = f"{exam}A{i}"
            questions.append({"problem_id": pid, "problem_text": f"（合成問題）{i}",
                              "choices": ["一", "二", "三", "四", "五"], "answer": ["a"],
                              "points": "1", "text_only": i % 4 != 0})
            meta.append({"problem_id": pid, "category": "循環器" if i % 2 else "神経",
                         "kinki": []})
            base_right = i > 30  # questions 1..30: the baseline is wrong
            preds["base"].append("a" if base_right else "b")
            for system, (c, b) in PLAN.items():
                right = (i <= c) if not base_right else not (30 < i <= 30 + b)
                preds[system].append("a" if right else "b")
        for name, rows in (("117-A" if exam == 117 else "118-A", questions),):
            (year_dir / f"{name}.jsonl").write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
            (year_dir / f"{name}_metadata.jsonl").write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in meta), "utf-8")
            for system, values in preds.items():
                out = pred_dir / system / f"{name}_{system}.jsonl"
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text("".join(json.dumps({"problem_id": q["problem_id"],
                                                   "prediction": v}) + "\n"
                                       for q, v in zip(questions, values, strict=True)), "utf-8")
    return gold_dir, pred_dir


@pytest.fixture
def table(tmp_path: Path) -> dict:
    gold_dir, pred_dir = synthetic_benchmark(tmp_path)
    gold = load_igakuqa(gold_dir).by_id()
    results = {s: evaluate(gold, load_predictions(pred_dir / s)) for s in ("base", *PLAN)}
    return build_table(results, "base", "official")


def test_accuracy_table_has_years_all_and_text_only(table: dict) -> None:
    assert table["columns"] == ["2023", "2024", "All", "All (text only)"]
    assert [r["system"] for r in table["rows"]] == ["base", "grpo", "gspo", "chord"]
    base = table["rows"][0]["cells"]
    assert base["All"]["n"] == 2 * N_PER_BLOCK and base["All"]["accuracy"] == 0.5
    assert base["All (text only)"]["n"] == 2 * N_PER_BLOCK * 3 // 4
    for row in table["rows"][1:]:
        c, b = PLAN[row["system"]]
        for column, scale in (("2023", 1), ("2024", 1), ("All", 2)):
            cell = row["cells"][column]
            assert (cell["b"], cell["c"]) == (b * scale, c * scale)
            expected = binomtest(min(b, c) * scale, (b + c) * scale, 0.5).pvalue
            assert cell["p_value"] == pytest.approx(expected, rel=1e-12, abs=0)
            assert cell["mark"] == ("**" if expected < 0.01 else "*" if expected < 0.05 else "")
            assert cell["delta"] == pytest.approx((c - b) * scale / (N_PER_BLOCK * scale))
    marks = {r["system"]: r["cells"]["2023"]["mark"] for r in table["rows"][1:]}
    assert marks == {"grpo": "**", "gspo": "", "chord": "*"}  # both thresholds are exercised


def test_pairwise_specialties_and_best_method(table: dict) -> None:
    pairs = {(r["system_a"], r["system_b"], r["subset"]) for r in table["pairwise"]}
    assert ("grpo", "gspo", "All") in pairs and ("gspo", "chord", "All (text only)") in pairs
    assert len(pairs) == 6
    by_name = {r["specialty"]: r for r in table["by_specialty"]}
    assert set(by_name) == {"循環器", "神経"} and all(r["n"] == N_PER_BLOCK for r in by_name.values())
    for row in by_name.values():
        correct = {m: row["systems"][m]["correct"] for m in PLAN}
        assert row["best"] == [m for m in PLAN if correct[m] == max(correct.values())]
    assert sum(table["best_counts"].values()) >= len(by_name)
    assert set(table["best_counts"]) == set(PLAN)


def test_markdown_prints_marks_and_three_digit_p(table: dict) -> None:
    markdown = render_markdown(table)
    grpo = next(r for r in table["rows"] if r["system"] == "grpo")["cells"]["All"]
    assert f"({100 * grpo['delta']:+.1f}**)" in markdown
    assert format_p(grpo["p_value"]) in markdown
    assert "| 2023 | 2024 | All | All (text only) |" in markdown
    assert "### By specialty" in markdown and "Best method per specialty" in markdown
    assert "Scoring rule: official:" in markdown


def test_one_cli_call_writes_markdown_json_and_pngs(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    gold_dir, pred_dir = synthetic_benchmark(tmp_path)
    out = tmp_path / "report"
    argv = ["eval", "table", *[f"{s}={pred_dir / s}" for s in ("base", *PLAN)],
            "--gold", str(gold_dir), "--out", str(out)]
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert (out / "table.md").read_text(encoding="utf-8") == stdout
    data = json.loads((out / "table.json").read_text(encoding="utf-8"))
    assert data["baseline"] == "base" and data["rule"] == "official"
    exact = data["rows"][1]["cells"]["All"]["p_value"]
    assert exact == pytest.approx(binomtest(4, 44, 0.5).pvalue, rel=1e-12, abs=0)
    for name in ("table.png", "specialty.png"):
        assert (out / name).read_bytes()[:8] == PNG


def test_labels_select_systems_in_a_shared_directory(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "table", f"beta={FIXTURE_BASELINES}", f"alpha={FIXTURE_BASELINES}",
            "--gold", str(FIXTURE), "--json", "--rule", "letter-set"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["systems"] == ["beta", "alpha"] and data["rule"] == "letter-set"
    assert data["rows"][0]["cells"]["All"]["n"] == 20


@pytest.mark.parametrize("argv, message", [
    (["grpo"], "must be LABEL=PATH"),
    ([f"a={FIXTURE_BASELINES}", f"a={FIXTURE_BASELINES}"], "labels must be unique"),
    ([f"alpha={FIXTURE_BASELINES}", "--baseline", "base"], "baseline 'base' is not one of"),
    ([f"x={FIXTURE_BASELINES}"], "several systems found"),
])
def test_bad_input_is_one_error_line(argv: list[str], message: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["eval", "table", *argv, "--gold", str(FIXTURE)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_spec_parsing() -> None:
    spec = parse_system_spec("grpo = runs/a=b")
    assert (spec.label, spec.path) == ("grpo", "runs/a=b")
    with pytest.raises(ValueError):
        parse_system_spec("=x")


@needs_real_igakuqa
def test_real_baselines_in_one_table(tmp_path: Path) -> None:
    gold = load_igakuqa(REAL_DIR).by_id()
    systems = ("student-majority", "gpt4", "chatgpt", "gpt3")
    results = {s: evaluate(gold, load_predictions(REAL_BASELINES, s)) for s in systems}
    data = build_table(results, "gpt3", "official")
    assert data["columns"][-2:] == ["All", "All (text only)"] and len(data["columns"]) == 7
    assert data["rows"][0]["cells"]["All"]["n"] == 2000
    assert len(data["by_specialty"]) == 28
    with pytest.raises(DataError, match="baseline 'base'"):
        build_table(results, "base", "official")


def _correct_ids(system: str, rule: str) -> dict[str, bool]:
    results = evaluate(load_igakuqa(FIXTURE).by_id(), load_predictions(FIXTURE_BASELINES, system), rule)
    return {r.question.problem_id: r.correct for r in results}


def test_include_and_exclude_lists_choose_the_questions(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`--include` then `--exclude` (one id per line, # comments): the table counts exactly the ids
    left, each system's score is its own on those ids, and the count is printed."""
    include = tmp_path / "include.txt"
    include.write_text("# 2018 only\n" + "\n".join(f"112A{i}" for i in range(1, 9)) + "\n112B1\n112B30\n",
                       encoding="utf-8")
    exclude = tmp_path / "exclude.txt"
    exclude.write_text("112A3  # a flawed one\n\n112B30\n", encoding="utf-8")
    argv = ["eval", "table", f"alpha={FIXTURE_BASELINES}", f"beta={FIXTURE_BASELINES}", "--gold", str(FIXTURE),
            "--include", str(include), "--exclude", str(exclude), "--json"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert (f"questions: 20 in the gold data, 8 counted (--include {include}: 10 ids; "
            f"--exclude {exclude}: 2 ids)") in captured.err
    data = json.loads(captured.out)
    kept = [*(f"112A{i}" for i in (1, 2, 4, 5, 6, 7, 8)), "112B1"]
    for row in data["rows"]:
        expected = _correct_ids(row["system"], "official")
        assert row["cells"]["All"]["n"] == len(kept)
        assert row["cells"]["All"]["correct"] == sum(expected[pid] for pid in kept)
    assert data["questions"]["kept"] == 8


def test_eval_igakuqa_takes_an_exclude_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exclude = tmp_path / "exclude.txt"
    exclude.write_text("116A1\n116A71\n", encoding="utf-8")
    argv = ["eval", "igakuqa", "--pred", str(FIXTURE_BASELINES), "--system", "gamma", "--gold", str(FIXTURE),
            "--exclude", str(exclude), "--json"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "20 in the gold data, 18 counted" in captured.err
    expected = _correct_ids("gamma", "official")
    assert json.loads(captured.out)["overall"]["n"] == 18
    assert json.loads(captured.out)["overall"]["correct"] == sum(v for k, v in expected.items()
                                                                 if k not in {"116A1", "116A71"})


def test_an_unknown_id_in_a_list_is_an_error_at_its_line(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    ids = tmp_path / "ids.txt"
    ids.write_text("112A1\n# typo below\n112A99\n", encoding="utf-8")
    argv = ["eval", "table", f"alpha={FIXTURE_BASELINES}", "--gold", str(FIXTURE), "--include", str(ids)]
    assert cli.main(argv) == 1
    assert capsys.readouterr().err.strip() == f"error: {ids}:3: id '112A99' is not a question of the gold data"
