"""The data the articles used: MedMCQA's `train[:1000]` with its `cop` base found (000), CHORD's expert
rows from five-part texts (001), and MedXpertQA read and scored (000's evaluation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.data.chord_sft import read_expert_texts
from megatron_rl.data.schema import DataError, PromptRecord, read_prompts, read_sft
from megatron_rl.tasks.mcq.scoring import score_mcq
from megatron_rl.tasks.medmcqa.data import ARTICLE_000_SYSTEM, detect_cop_base
from megatron_rl.tasks.medmcqa.rewards import medmcqa_strict
from megatron_rl.tasks.medxpertqa.data import read_medxpertqa

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MEDXPERTQA = FIXTURES / "medxpertqa" / "test.jsonl"
EXPERT_TEXTS = FIXTURES / "chord_sft" / "expert_texts.jsonl"


def _medmcqa(path: Path, cops: list[int]) -> Path:
    rows = [{"id": f"m{i}", "question": f"Question {i}?", "opa": "alpha", "opb": "beta", "opc": "gamma",
             "opd": "delta", "cop": cop, "exp": None, "subject_name": "Anatomy", "topic_name": None}
            for i, cop in enumerate(cops)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# --- MedMCQA (article 000) ---------------------------------------------------------------------

def test_cop_base_is_read_from_the_values_a_file_holds(tmp_path: Path) -> None:
    assert detect_cop_base(_medmcqa(tmp_path / "hf.jsonl", [0, 2, 3, 1]))[0] == 0
    assert detect_cop_base(_medmcqa(tmp_path / "orig.jsonl", [4, 1, 2]))[0] == 1
    with pytest.raises(DataError, match=r"takes only \[1, 2, 3\].*cannot tell.*--cop-base 0 or 1"):
        detect_cop_base(_medmcqa(tmp_path / "amb.jsonl", [1, 3, 2, 2]))
    with pytest.raises(DataError, match=r"both 0 and 4"):
        detect_cop_base(_medmcqa(tmp_path / "mixed.jsonl", [0, 4]))


def test_prepare_medmcqa_limit_is_train_head_and_the_hf_copy_maps_0_to_a(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _medmcqa(tmp_path / "train.jsonl", [0, 3, 1, 2, 0, 1])       # the HF copy: 0-based
    code, out, err = _run(capsys, "data", "prepare", "medmcqa", "--src", src, "--out", tmp_path / "o",
                          "--limit", "4", "--style", "article000")
    assert code == 0, err
    assert "cop base 0 (cop values [0, 1, 2, 3]: 0-based" in out and "medmcqa_train.jsonl: 4 records" in out
    prompts = read_prompts(tmp_path / "o" / "medmcqa_train.jsonl")
    assert [p.id for p in prompts] == ["medmcqa-m0", "medmcqa-m1", "medmcqa-m2", "medmcqa-m3"]
    assert [p.answer for p in prompts] == [["a"], ["d"], ["b"], ["c"]]
    system, user = prompts[0].messages
    assert system == {"role": "system", "content": ARTICLE_000_SYSTEM}          # article 000's, verbatim
    assert user["content"] == "Question 0?\n\nA. alpha\nB. beta\nC. gamma\nD. delta"
    # The article's own answer formats score with the recipe's reward, against each question's gold.
    assert medmcqa_strict("... Final answer: D", prompts[1].to_dict()) == 1.0
    assert medmcqa_strict("The correct answer is A", prompts[1].to_dict()) == 0.1
    summary = json.loads((tmp_path / "o" / "medmcqa_train_prepare.json").read_text(encoding="utf-8"))
    assert summary["notes"]["cop_base"] == 0 and summary["notes"]["limit"] == 4


def test_prepare_medmcqa_refuses_a_file_it_cannot_read_the_base_of(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _medmcqa(tmp_path / "train.jsonl", [1, 2, 3])
    code, _, err = _run(capsys, "data", "prepare", "medmcqa", "--src", src, "--out", tmp_path / "o")
    assert code == 1 and "cannot tell the Hugging Face copy (0-3) from the original release (1-4)" in err
    assert not (tmp_path / "o").exists()
    code, _, err = _run(capsys, "data", "prepare", "medmcqa", "--src", src, "--out", tmp_path / "o", "--cop-base", "1")
    assert code == 0, err
    assert [p.answer for p in read_prompts(tmp_path / "o" / "medmcqa_train.jsonl")] == [["a"], ["b"], ["c"]]


# --- CHORD expert rows (article 001) -----------------------------------------------------------

def test_chord_sft_builds_question_and_five_part_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(json.dumps(PromptRecord(
        id="x", source="igakuqa", answer=["a"],
        messages=[{"role": "user", "content": "ウェルニッケ脳症の原因となるビタミン欠乏は何ですか。（合成例）"}],
    ).to_dict(), ensure_ascii=False) + "\n", encoding="utf-8")
    code, out, err = _run(capsys, "data", "prepare", "chord-sft", "--src", EXPERT_TEXTS, "--out", tmp_path / "o",
                          "--exclude", held_out)
    assert code == 0, err
    assert "chord_sft.jsonl: 2 records" in out and "excluded from training: 1 (question_in_excluded_prompts)" in out
    rows = read_sft(tmp_path / "o" / "chord_sft.jsonl")
    assert [r.id for r in rows] == ["chord-0001", "chord-0003"]
    first = rows[0]
    assert first.messages == [{"role": "user", "content": read_expert_texts(EXPERT_TEXTS)[0].question}]
    assert first.response.startswith("【病態】\n下壁は多くの場合右冠動脈が灌流する。\n\n【診断】\n")
    assert first.response.count("【") == 5 and first.metadata == {"parts": 5} and first.source == "synthetic"
    assert rows[1].response.startswith("β遮断薬") and rows[1].metadata == {"parts": 1}
    # --parts 5 refuses the one-part row, naming it; a system message is added when asked.
    code, _, err = _run(capsys, "data", "prepare", "chord-sft", "--src", EXPERT_TEXTS, "--out", tmp_path / "p",
                        "--parts", "5")
    assert code == 1 and "row 'chord-0003' has 1 sections; --parts asks for 5" in err
    code, _, err = _run(capsys, "data", "prepare", "chord-sft", "--src", EXPERT_TEXTS, "--out", tmp_path / "q",
                        "--system-prompt", "あなたは医師です。", "--limit", "1")
    assert code == 0, err
    (row,) = read_sft(tmp_path / "q" / "chord_sft.jsonl")
    assert row.messages[0] == {"role": "system", "content": "あなたは医師です。"}


def test_chord_sft_format_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "question": "q", "sections": [{"title": "t", "text": ""}]}) + "\n"
                   + json.dumps({"id": "b", "question": "q", "response": "r", "sections": []}) + "\n",
                   encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: sections\[0\] needs a non-empty str 'text'"):
        read_expert_texts(bad)
    assert read_expert_texts(bad, on_malformed="skip") == []


# --- MedXpertQA (article 000's evaluation) -----------------------------------------------------

def test_medxpertqa_reader_reads_the_published_format() -> None:
    questions = read_medxpertqa(MEDXPERTQA)
    text0 = questions[0]
    assert text0.id == "Text-0" and len(text0.options) == 10 and text0.answer == "c"
    assert text0.stem.endswith("Which artery is most likely occluded?") and "Answer Choices" not in text0.stem
    assert (text0.medical_task, text0.body_system, text0.question_type) == ("Diagnosis", "Cardiovascular", "Reasoning")
    assert questions[3].images == ("MM-26-a.jpeg",) and len(questions[3].options) == 5


def test_medxpertqa_prepare_generate_format_and_score(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "data", "prepare", "medxpertqa", "--src", MEDXPERTQA, "--out", tmp_path)
    assert code == 0, err
    assert "medxpertqa_test.jsonl: 3 records" in out and "excluded from training: 1 (needs_image)" in out
    prompts = read_prompts(tmp_path / "medxpertqa_test.jsonl")
    assert "j. Acute marginal branch" in prompts[0].messages[-1]["content"]
    assert "[ans]a[/ans]" in prompts[0].messages[-1]["content"]
    pred = tmp_path / "pred.jsonl"
    pred.write_text("".join(json.dumps({"problem_id": pid, "output": text}) + "\n" for pid, text in [
        ("Text-0", "Inferior wall... [ans]c[/ans]"),                 # correct, tag
        ("Text-1", "Thiamine deficiency.\nThe correct answer is (D)"),  # correct, statement
        # Text-2: missing
    ]), encoding="utf-8")
    code, out, err = _run(capsys, "eval", "mcq", "--pred", pred, "--gold", tmp_path / "medxpertqa_test.jsonl",
                          "--by", "medical_task,question_type", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["overall"] == {"n": 3, "correct": 2, "accuracy": pytest.approx(2 / 3), "no_answer": 0, "missing": 1}
    assert report["by"]["medical_task"]["Treatment"] == {"n": 1, "correct": 0, "accuracy": 0.0}
    assert report["by"]["question_type"]["Reasoning"]["n"] == 2
    code, out, _ = _run(capsys, "eval", "mcq", "--pred", pred, "--gold", tmp_path / "medxpertqa_test.jsonl")
    assert code == 0 and "| 3 | 2 | 66.67 % | 0 | 1 |" in out


def test_mcq_scorer_reads_letters_up_to_the_question_s_last_option() -> None:
    record = PromptRecord(id="q", source="medxpertqa", answer=["i"], choices=[str(i) for i in range(10)],
                          messages=[{"role": "user", "content": "?"}])
    assert score_mcq([record], {"q": "The correct answer is I"})["overall"]["correct"] == 1
    four = PromptRecord(id="q", source="medmcqa", answer=["d"], choices=["w", "x", "y", "z"],
                        messages=[{"role": "user", "content": "?"}])
    report = score_mcq([four], {"q": "The correct answer is I"})        # no option I in a-d
    assert report["overall"]["no_answer"] == 1
    with pytest.raises(DataError, match="name no prompt"):
        score_mcq([four], {"other": "x"})
