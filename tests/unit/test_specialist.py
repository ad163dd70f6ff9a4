"""The specialist exam: the input format's checks (file:line errors), and `eval specialist`'s tables
on the synthetic fixture (tests/fixtures/specialist), from the CLI, against the numbers worked out by
hand in the fixture's README; the McNemar p-values also against scipy's exact binomial test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scipy.stats import binomtest

from megatron_rl import cli

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "specialist"
SYSTEMS = [f"{s}={FIXTURE / 'pred' / f'{s}.jsonl'}" for s in ("base", "grpo", "gspo", "chord")]
IMAGE_IDS = ["sp-07", "sp-08", "sp-15", "sp-16", "sp-21", "sp-22", "sp-27", "sp-28", "sp-33", "sp-34",
             "sp-39", "sp-40", "sp-44"]


@pytest.fixture(scope="module")
def gold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("specialist")
    assert cli.main(["data", "prepare", "specialist", "--src", str(FIXTURE / "exam.jsonl"), "--out", str(out)]) == 0
    return out / "specialist_test.jsonl"


@pytest.fixture(scope="module")
def result(gold: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("table")
    assert cli.main(["eval", "specialist", *SYSTEMS, "--gold", str(gold), "--out", str(out)]) == 0
    return json.loads((out / "table.json").read_text(encoding="utf-8")), out


def _cells(table: dict) -> dict[str, dict]:
    return {row["system"]: row["cells"] for row in table["rows"]}


def test_prepared_prompts_keep_specialty_image_and_gold(gold: Path) -> None:
    rows = [json.loads(line) for line in gold.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 44
    by_id = {r["id"]: r for r in rows}
    assert by_id["sp-05"]["answer"] == ["a", "c"] and by_id["sp-06"]["answer"] == ["a"]  # "a" from a string
    assert by_id["sp-44"]["metadata"] == {"specialty": "小児", "has_image": True}
    assert sum(r["metadata"]["has_image"] for r in rows) == 13
    assert "e. 選択肢e（問2）" in by_id["sp-02"]["messages"][-1]["content"]     # choices given as an object


def test_all_and_text_only_with_delta_and_mcnemar(result: tuple[dict, Path]) -> None:
    table, _ = result
    cells = _cells(table)
    expected = {  # system: (All correct, b, c, p), (text-only correct, b, c, p): the README's table
        "grpo": ((31, 1, 10, 24 / 2048), (23, 1, 8, 20 / 512)),
        "gspo": ((32, 0, 10, 2 / 1024), (25, 0, 9, 2 / 512)),
        "chord": ((23, 2, 3, 1.0), (17, 2, 3, 1.0)),
    }
    assert (cells["base"]["All"]["n"], cells["base"]["All"]["correct"]) == (44, 22)
    assert (cells["base"]["All (text only)"]["n"], cells["base"]["All (text only)"]["correct"]) == (31, 16)
    for system, columns in expected.items():
        for column, n, base_correct, (correct, b, c, p) in zip(("All", "All (text only)"), (44, 31), (22, 16),
                                                               columns, strict=True):
            cell = cells[system][column]
            assert (cell["n"], cell["correct"], cell["b"], cell["c"]) == (n, correct, b, c), (system, column)
            assert cell["accuracy"] == correct / n
            assert cell["delta"] == pytest.approx((correct - base_correct) / n, abs=1e-15)
            assert cell["p_value"] == pytest.approx(p, abs=1e-12)
            assert abs(cell["p_value"] - binomtest(min(b, c), b + c, 0.5).pvalue) < 1e-12
    assert [cells[s]["All"]["mark"] for s in expected] == ["*", "**", ""]
    assert [cells[s]["All (text only)"]["mark"] for s in expected] == ["*", "**", ""]
    assert table["missing"] == {"base": 0, "grpo": 0, "gspo": 1, "chord": 1}
    assert table["format_failures"] == {"base": 1, "grpo": 0, "gspo": 0, "chord": 0}


def test_mcnemar_between_methods(result: tuple[dict, Path]) -> None:
    table, _ = result
    pair = next(r for r in table["pairwise"]
                if (r["system_a"], r["system_b"], r["subset"]) == ("grpo", "chord", "All"))
    assert (pair["b"], pair["c"]) == (11, 3)
    assert pair["p_value"] == pytest.approx(940 / 16384, abs=1e-12)
    assert abs(pair["p_value"] - binomtest(3, 14, 0.5).pvalue) < 1e-12
    assert pair["delta"] == pytest.approx((23 - 31) / 44, abs=1e-15)
    assert {(r["system_a"], r["system_b"]) for r in table["pairwise"]} == {
        ("grpo", "gspo"), ("grpo", "chord"), ("gspo", "chord")}


def test_per_specialty_delta_best_method_and_counts(result: tuple[dict, Path]) -> None:
    table, out = result
    rows = [(r["specialty"], r["n"], *(r["systems"][s]["correct"] for s in ("base", "grpo", "gspo", "chord")),
             r["best"]) for r in table["by_specialty"]]
    assert rows == [("循環器", 16, 8, 12, 11, 7, ["grpo"]), ("消化器", 12, 6, 8, 11, 5, ["gspo"]),
                    ("神経", 12, 6, 8, 8, 9, ["chord"]), ("小児", 4, 2, 3, 2, 2, ["grpo"])]
    cardio = table["by_specialty"][0]["systems"]
    assert cardio["gspo"]["delta"] == pytest.approx(0.1875, abs=1e-15)
    assert cardio["grpo"]["p_value"] == pytest.approx(14 / 64, abs=1e-12)
    assert table["best_counts"] == {"grpo": 2, "gspo": 1, "chord": 1}
    markdown = (out / "table.md").read_text(encoding="utf-8")
    assert "| grpo | 70.5% (+20.5*) | 74.2% (+22.6*) |" in markdown
    assert "| 0.0117 * (b 1, c 10) |" in markdown
    assert "grpo 2, gspo 1, chord 1" in markdown
    for png in ("table.png", "specialty.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exclude_list_is_applied_and_counted(gold: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    ids = tmp_path / "images.txt"
    ids.write_text("# the figure questions\n" + "\n".join(IMAGE_IDS) + "\n", encoding="utf-8")
    assert cli.main(["eval", "specialist", *SYSTEMS, "--gold", str(gold), "--exclude", str(ids), "--json"]) == 0
    captured = capsys.readouterr()
    table = json.loads(captured.out)
    assert f"44 in the gold data, 31 counted (--exclude {ids}: 13 ids)" in captured.err
    cells = _cells(table)
    assert cells["grpo"]["All"] == cells["grpo"]["All (text only)"]
    assert (cells["grpo"]["All"]["n"], cells["grpo"]["All"]["correct"]) == (31, 23)
    assert table["questions"]["kept"] == 31


@pytest.mark.parametrize("line, problem", [
    ({"id": "x", "specialty": "a", "question": "q", "choices": ["1", "2"], "answer": ["c"], "has_image": False},
     "key 'answer' must be letters a–b"),
    ({"id": "x", "specialty": "a", "question": "q", "choices": ["1", "2"], "answer": ["a"]},
     "missing key 'has_image'"),
    ({"id": "x", "specialty": "", "question": "q", "choices": ["1", "2"], "answer": ["a"], "has_image": False},
     "key 'specialty' must not be empty"),
    ({"id": "x", "specialty": "a", "question": "q", "choices": {"a": "1", "c": "2"}, "answer": "a",
      "has_image": False}, "lettered a, b"),
    ({"id": "x", "specialty": "a", "question": "q", "choices": ["1", "2"], "answer": "a", "has_image": False,
      "image": "f.png"}, "unknown keys ['image']"),
    ({"id": "sp-01", "specialty": "a", "question": "q", "choices": ["1", "2"], "answer": "a", "has_image": False},
     "duplicate id 'sp-01' (first at line 1)"),
])
def test_bad_lines_are_refused_with_file_and_line(line: dict, problem: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "exam.jsonl"
    first = (FIXTURE / "exam.jsonl").read_text(encoding="utf-8").splitlines()[0]
    src.write_text(first + "\n\n" + json.dumps(line, ensure_ascii=False) + "\n", encoding="utf-8")
    assert cli.main(["data", "prepare", "specialist", "--src", str(src), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src}:3: ") and problem in err, err


@pytest.mark.parametrize("line, problem", [
    ('{"problem_id": "sp-99", "output": "[ans]a[/ans]"}', "'sp-99' is not a question of the gold file"),
    ('{"problem_id": "sp-01", "output": "[ans]a[/ans]"}', "'sp-01' appears twice (first at line 1)"),
    ('{"problem_id": "sp-02"}', "missing key 'output'"),
])
def test_bad_predictions_are_refused_with_file_and_line(line: str, problem: str, gold: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    pred = tmp_path / "bad.jsonl"
    pred.write_text('{"problem_id": "sp-01", "prediction": "a"}\n' + line + "\n", encoding="utf-8")
    assert cli.main(["eval", "specialist", SYSTEMS[0], f"bad={pred}", "--gold", str(gold)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {pred}:2: ") and problem in err, err
