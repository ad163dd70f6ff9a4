"""IgakuQA scoring and report: published baselines against an independent implementation of the
benchmark's rule, special cases, raw-output parsing, pass/fail, comparison tables."""

from __future__ import annotations

import glob
import json
import unicodedata
from collections import defaultdict
from pathlib import Path

import pytest
from scipy.stats import binomtest

from megatron_rl.data.igakuqa import load_igakuqa
from megatron_rl.data.schema import DataError
from megatron_rl.eval.compare import compare_results, plot_category_deltas, render_markdown
from megatron_rl.eval.igakuqa_report import QuestionResult, build_report, evaluate
from megatron_rl.eval.igakuqa_report import render_markdown as report_markdown
from megatron_rl.eval.scoring import load_predictions

IGAKUQA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "igakuqa"
BASELINES = IGAKUQA_DIR / "baseline_results"
SYSTEMS = ("gpt4", "chatgpt", "gpt3", "student-majority", "translate_chatgpt-en")


# --- an independent, deliberately plain implementation of the README's rule ------------------

def read_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def raw_gold() -> dict[str, dict]:
    gold = {}
    for path in glob.glob(str(IGAKUQA_DIR / "data" / "*" / "*.jsonl")):
        if "_" not in Path(path).name:
            for row in read_rows(path):
                gold[row["problem_id"]] = row
    return gold


def plain_correct(problem_id: str, prediction: str, gold: dict[str, dict]) -> bool:
    letters = sorted({part.strip() for part in prediction.split(",")})
    if problem_id == "116A71":
        return True
    if problem_id == "112B30":
        return letters in (["a"], ["d"])
    return letters == sorted(set(gold[problem_id]["answer"]))


def plain_scores(system: str, gold: dict[str, dict]) -> dict[str, list[int]]:
    """block → [questions, correct, points earned, points possible]."""
    scores: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for path in glob.glob(str(BASELINES / "*" / f"*_{system}.jsonl")):
        block = Path(path).name.split("_")[0]
        for row in read_rows(path):
            points = int(gold[row["problem_id"]]["points"])
            ok = plain_correct(row["problem_id"], row["prediction"], gold)
            entry = scores[block]
            entry[0] += 1
            entry[1] += ok
            entry[2] += points if ok else 0
            entry[3] += points
    return scores


@pytest.fixture(scope="module")
def gold_raw() -> dict[str, dict]:
    return raw_gold()


@pytest.fixture(scope="module")
def gold() -> dict:
    return load_igakuqa(IGAKUQA_DIR).by_id()


@pytest.fixture(scope="module")
def reports(gold: dict) -> dict[str, dict]:
    return {s: build_report(evaluate(gold, load_predictions(BASELINES, s)), s) for s in SYSTEMS}


# --- published baselines ---------------------------------------------------------------------

@pytest.mark.parametrize("system", SYSTEMS)
def test_baselines_score_as_the_official_rule_says(system: str, gold_raw: dict,
                                                   reports: dict) -> None:
    expected = plain_scores(system, gold_raw)
    report = reports[system]
    got = {r["block"]: [r["n"], r["correct"], r["score"], r["total"]] for r in report["by_block"]}
    assert got == dict(expected)
    totals = [sum(v[i] for v in expected.values()) for i in range(4)]
    overall = report["overall"]
    assert [overall["n"], overall["correct"], overall["score"], overall["total"]] == totals
    assert overall["n"] == 2000
    assert overall["accuracy"] == totals[1] / totals[0]
    for year_row in report["by_year"]:
        exam = str(year_row["exam"])
        year_blocks = [v for k, v in expected.items() if k.startswith(exam)]
        assert year_row["correct"] == sum(v[1] for v in year_blocks)
        assert year_row["score"] == sum(v[2] for v in year_blocks)


def test_baseline_ordering_and_verdicts(reports: dict) -> None:
    acc = {s: reports[s]["overall"]["accuracy"] for s in SYSTEMS}
    assert acc["student-majority"] > acc["gpt4"] > acc["chatgpt"] > acc["gpt3"]
    # Kasai et al.: GPT-4 passes every year, ChatGPT and GPT-3 fail.
    for system, verdict in (("gpt4", "pass"), ("student-majority", "pass"),
                            ("chatgpt", "fail"), ("gpt3", "fail")):
        assert [y["pass"]["status"] for y in reports[system]["by_year"]] == [verdict] * 5


def test_prohibited_and_format_failure_counts(gold_raw: dict, reports: dict) -> None:
    kinki = {}
    for path in glob.glob(str(IGAKUQA_DIR / "data" / "*" / "*_metadata.jsonl")):
        for row in read_rows(path):
            # Entries are letters, sometimes full-width or run together ("de" = d and e).
            kinki[row["problem_id"]] = {ch for entry in row["kinki"]
                                        for ch in unicodedata.normalize("NFKC", entry).strip()}
    for system in SYSTEMS:
        prohibited = 0
        for path in glob.glob(str(BASELINES / "*" / f"*_{system}.jsonl")):
            for row in read_rows(path):
                letters = {part.strip() for part in row["prediction"].split(",")}
                prohibited += bool(letters & kinki[row["problem_id"]])
        assert reports[system]["overall"]["prohibited"] == prohibited
    # Empty student-majority predictions (the numeric questions) are format failures.
    empty = sum(1 for path in glob.glob(str(BASELINES / "*" / "*_student-majority.jsonl"))
                for row in read_rows(path) if not row["prediction"].strip())
    assert empty > 0
    assert reports["student-majority"]["overall"]["format_failures"] == empty


# --- special cases ---------------------------------------------------------------------------

def write_predictions(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def single(gold: dict, tmp_path: Path, problem_id: str, prediction: str) -> QuestionResult:
    path = write_predictions(tmp_path / f"{problem_id}.jsonl",
                             [{"problem_id": problem_id, "prediction": prediction}])
    results = evaluate(gold, load_predictions(path))
    return next(r for r in results if r.question.problem_id == problem_id)


@pytest.mark.parametrize("prediction", ["a", "b", "e", "a,b", "", "分からない"])
def test_116A71_is_correct_for_every_answer(gold: dict, tmp_path: Path, prediction: str) -> None:
    result = single(gold, tmp_path, "116A71", prediction)
    assert result.correct and result.earned == 1


@pytest.mark.parametrize("prediction, correct, prohibited", [
    ("a", True, False), ("d", True, False), ("a,d", False, False), ("b", False, False),
    ("e", False, True), ("a or d", False, False),
])
def test_112B30_accepts_a_or_d(gold: dict, tmp_path: Path, prediction: str, correct: bool,
                               prohibited: bool) -> None:
    result = single(gold, tmp_path, "112B30", prediction)
    assert (result.correct, result.prohibited, result.earned) == (correct, prohibited,
                                                                  3 if correct else 0)


def test_spaced_multi_answer_predictions_count_as_letter_sets(gold: dict, tmp_path: Path) -> None:
    multi = next(q for q in gold.values() if len(q.answer) == 2)
    spaced = ", ".join(reversed(multi.answer))
    assert single(gold, tmp_path, multi.problem_id, spaced).correct


# --- raw outputs, coverage and errors --------------------------------------------------------

def test_raw_outputs_are_parsed_with_the_answer_tag(gold: dict, tmp_path: Path) -> None:
    block = [q for q in gold.values() if q.exam_block == "116-B"]
    rows = []
    for i, q in enumerate(block):
        if i % 3 == 0:
            rows.append({"problem_id": q.problem_id,
                         "output": f"考察。[ans]x[/ans]訂正。[ans]{','.join(q.answer)}[/ans]"})
        elif i % 3 == 1:
            rows.append({"problem_id": q.problem_id, "output": "答えは分かりません。"})
    path = write_predictions(tmp_path / "raw" / "116-B_mymodel.jsonl", rows)
    predictions = load_predictions(tmp_path / "raw")
    assert predictions.system == "mymodel"
    report = build_report(evaluate(gold, predictions), predictions.system)
    overall = report["overall"]
    n_tagged = len(range(0, len(block), 3))
    n_untagged = len(range(1, len(block), 3))
    assert overall["n"] == len(block)
    assert overall["correct"] == n_tagged
    assert overall["format_failures"] == n_untagged
    assert overall["missing"] == len(block) - len(rows)
    assert report["by_year"][0]["pass"]["status"] == "n/a"
    assert "incomplete exam" in report["by_year"][0]["pass"]["reason"]
    markdown = report_markdown(report)
    assert "## IgakuQA: mymodel" in markdown and "| 116-B |" in markdown
    assert path.exists()


def test_pass_fail_thresholds(gold: dict, tmp_path: Path) -> None:
    year = [q for q in gold.values() if q.exam == 112]
    required_one_point = [q for q in year if q.required and q.points == 1]
    required_total = sum(q.points for q in year if q.required)
    assert required_total == 200

    def verdict(wrong_required: int, kinki_picks: int) -> dict:
        wrong = {q.problem_id for q in required_one_point[:wrong_required]}
        kinki_questions = [q for q in year if q.kinki and q.problem_id not in wrong
                           and not q.required][:kinki_picks]
        picks = {q.problem_id: q.kinki[0] for q in kinki_questions}
        rows = []
        for q in year:
            pred = ",".join(q.answer)
            if q.problem_id in wrong:
                pred = "z"
            elif q.problem_id in picks:
                pred = picks[q.problem_id]
            rows.append({"problem_id": q.problem_id, "prediction": pred})
        path = write_predictions(tmp_path / f"v{wrong_required}_{kinki_picks}.jsonl", rows)
        return build_report(evaluate(gold, load_predictions(path)), "v")["by_year"][0]["pass"]

    assert verdict(40, 0)["status"] == "pass"  # 160/200: exactly the threshold
    failing = verdict(41, 0)
    assert (failing["status"], failing["required_score"]) == ("fail", 159)
    assert verdict(0, 3)["status"] == "pass"
    too_many = verdict(0, 4)
    assert (too_many["status"], too_many["prohibited"]) == ("fail", 4)


def test_unknown_and_duplicate_predictions_are_errors(gold: dict, tmp_path: Path) -> None:
    path = write_predictions(tmp_path / "p.jsonl", [{"problem_id": "112A1", "prediction": "a"},
                                                    {"problem_id": "999Z1", "prediction": "a"}])
    with pytest.raises(DataError, match=r"p\.jsonl:2: problem_id '999Z1' is not in the gold"):
        evaluate(gold, load_predictions(path))
    path = write_predictions(tmp_path / "d.jsonl", [{"problem_id": "112A1", "prediction": "a"},
                                                    {"problem_id": "112A1", "prediction": "b"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: duplicate prediction for '112A1'"):
        load_predictions(path)
    path = write_predictions(tmp_path / "m.jsonl", [{"problem_id": "112A1", "answer": "a"}])
    with pytest.raises(DataError, match=r"m\.jsonl:1: missing key 'prediction'"):
        load_predictions(path)


def test_directory_needs_a_system_when_several_are_present() -> None:
    with pytest.raises(DataError, match="several systems found .*--system"):
        load_predictions(BASELINES)
    with pytest.raises(DataError, match="no files for system 'gpt5'"):
        load_predictions(BASELINES, "gpt5")
    assert len(load_predictions(BASELINES, "gpt4").files) == 30


# --- comparison ------------------------------------------------------------------------------

def test_compare_chatgpt_gpt4_discordant_pairs(gold: dict, gold_raw: dict, tmp_path: Path) -> None:
    a = evaluate(gold, load_predictions(BASELINES, "chatgpt"))
    b = evaluate(gold, load_predictions(BASELINES, "gpt4"))
    comparison = compare_results(a, b, "chatgpt", "gpt4")

    def plain(system: str) -> dict[str, bool]:
        return {row["problem_id"]: plain_correct(row["problem_id"], row["prediction"], gold_raw)
                for path in glob.glob(str(BASELINES / "*" / f"*_{system}.jsonl"))
                for row in read_rows(path)}

    ca, cb = plain("chatgpt"), plain("gpt4")
    only_a = sum(1 for pid in ca if ca[pid] and not cb[pid])
    only_b = sum(1 for pid in ca if cb[pid] and not ca[pid])
    overall = comparison["overall"]
    assert (overall["n"], overall["b"], overall["c"]) == (2000, only_a, only_b)
    expected_p = binomtest(min(only_a, only_b), only_a + only_b, 0.5).pvalue
    assert overall["p_value"] == pytest.approx(expected_p, rel=1e-12, abs=0)
    assert overall["delta"] == pytest.approx((sum(cb.values()) - sum(ca.values())) / 2000)
    assert [r["subset"] for r in comparison["by_year"]] == ["2018", "2019", "2020", "2021", "2022"]
    assert sum(r["n"] for r in comparison["by_category"]) == 2000
    assert sum(r["b"] for r in comparison["by_year"]) == only_a
    assert {r["subset"] for r in comparison["text_only"]} == {"text only", "image missing"}

    markdown = render_markdown(comparison)
    assert "| overall | 2000 |" in markdown and "### By category" in markdown
    png = plot_category_deltas(comparison, tmp_path / "delta.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_uses_shared_blocks_only(gold: dict, tmp_path: Path) -> None:
    def block_preds(blocks: tuple[str, ...], name: str) -> Path:
        rows = [{"problem_id": q.problem_id, "prediction": ",".join(q.answer)}
                for q in gold.values() if q.exam_block in blocks]
        return write_predictions(tmp_path / f"{name}.jsonl", rows)

    a = evaluate(gold, load_predictions(block_preds(("112-A", "112-B"), "a")))
    b = evaluate(gold, load_predictions(block_preds(("112-B", "112-C"), "b")))
    comparison = compare_results(a, b, "a", "b")
    n_112b = sum(1 for q in gold.values() if q.exam_block == "112-B")
    assert comparison["overall"]["n"] == n_112b
    assert comparison["overall"]["p_value"] == 1.0
    assert comparison["excluded_blocks"] == ["112-A", "112-C"]
