"""Data layer: IgakuQA and MedMCQA readers, record schemas, prompts, preparation and malformed
lines."""

from __future__ import annotations

import glob
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_rl.data.prompts import format_prompt
from megatron_rl.data.schema import (
    DataError,
    PromptRecord,
    ReadStats,
    SFTRecord,
    read_prompts,
    read_sft,
    write_jsonl,
)
from megatron_rl.tasks.igakuqa.data import load_igakuqa, parse_problem_id
from megatron_rl.tasks.igakuqa.prepare import prepare_igakuqa
from megatron_rl.tasks.mcq.answer import extract_answer
from megatron_rl.tasks.mcq.prompts import build_messages, render_question
from megatron_rl.tasks.medmcqa.data import prepare_medmcqa, read_medmcqa
from tests.helpers.igakuqa import FIXTURE, REAL_DIR, needs_real_igakuqa


def raw_questions(root: Path = FIXTURE) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(str(root / "data" / "*" / "*.jsonl"))):
        if "_" not in Path(path).name:
            with open(path, encoding="utf-8") as handle:
                rows.extend(json.loads(line) for line in handle)
    return rows


def write_lines(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def question_line(pid: str, answer: object = ("a",), **overrides: object) -> str:
    obj = {"problem_id": pid, "problem_text": "問題文", "choices": ["一", "二", "三", "四", "五"],
           "answer": list(answer) if isinstance(answer, tuple) else answer, "points": "1",
           "text_only": True}
    obj.update(overrides)
    return json.dumps(obj, ensure_ascii=False)


# --- IgakuQA reader on the fixture and on the real data -------------------------------------

def test_reads_fixture_questions_with_metadata() -> None:
    raw = raw_questions()
    dataset = load_igakuqa(FIXTURE)
    assert len(dataset.questions) == len(raw) == 20
    assert dataset.years == [2018, 2022]
    by_id = dataset.by_id()
    for row in raw:
        q = by_id[row["problem_id"]]
        assert (q.problem_text, list(q.choices), q.points, q.text_only) == (
            row["problem_text"], row["choices"], int(row["points"]), row["text_only"])
        assert list(q.answer_as_written) == row["answer"]
    q = by_id["112B30"]
    assert (q.answer, q.alternatives, q.kinki, q.category) == (("a",), (("d",),), ("e",), "産科")
    assert (q.exam, q.block, q.number, q.year, q.required, q.points) == (112, "B", 30, 2018,
                                                                         True, 3)
    assert by_id["112A6"].kinki == ("a", "b")  # written "ab" in the metadata
    assert by_id["112A4"].kinki == ("b",)  # written full-width "ｂ"
    assert by_id["116A3"].answer == ("04",) and by_id["112A5"].choices == ()


@needs_real_igakuqa
def test_reads_all_real_questions_with_metadata() -> None:
    raw = raw_questions(REAL_DIR)
    dataset = load_igakuqa(REAL_DIR)
    assert len(dataset.questions) == len(raw) == 2000
    assert dataset.years == [2018, 2019, 2020, 2021, 2022]
    by_id = dataset.by_id()
    for row in raw:
        q = by_id[row["problem_id"]]
        assert q.problem_text == row["problem_text"]
        assert list(q.choices) == row["choices"]
        assert q.points == int(row["points"])
        assert q.text_only is row["text_only"]
        if row["problem_id"] != "112B30":
            assert set(q.answer) == set(row["answer"])
    q = by_id["112B30"]
    assert (q.answer, q.alternatives, q.kinki, q.category) == (("a",), (("d",),), ("e",), "産科")
    assert by_id["112D50"].kinki == ("d", "e")  # written "de" in the metadata
    assert by_id["112F66"].kinki == ("b",)  # written full-width "ｂ"
    assert (q.exam, q.block, q.number, q.year, q.required) == (112, "B", 30, 2018, True)
    assert by_id["116A71"].category == "小児科"
    assert sum(1 for q in dataset.questions if not q.choices) == sum(
        1 for row in raw if not row["choices"])


def test_reader_accepts_the_data_subdirectory_and_year_filter() -> None:
    dataset = load_igakuqa(FIXTURE / "data", years=[2022])
    assert {q.exam for q in dataset.questions} == {116}
    assert len(dataset.questions) == 6


def test_parse_problem_id() -> None:
    assert parse_problem_id("116A71") == (116, "A", 71)
    assert parse_problem_id("95A1") == (95, "A", 1)           # exams 95–99 (2001–2005)
    assert parse_problem_id("095A1") == (95, "A", 1)
    assert parse_problem_id("112a1") is None
    assert parse_problem_id("x") is None


# --- malformed lines -------------------------------------------------------------------------

# Each bad line sits at this line number in the test file, after good lines.
BAD_LINES: dict[int, tuple[str, str]] = {
    2: ('{"problem_id": "112A2", "problem_text": ', "bad JSON"),
    3: (question_line("112A3").replace('"answer"', '"answr"'), "missing key 'answer'"),
    4: (question_line("112A4", answer="a"), "key 'answer' must be list, got str"),
    5: (question_line("112A5", answer=("f",)), "answer 'f' is not one of the 5 choice letters"),
    6: (question_line("112A6", points="two"), "key 'points' must be a non-negative integer"),
}


def malformed_dir(tmp_path: Path) -> Path:
    lines = [question_line("112A1")] + [BAD_LINES[i][0] for i in sorted(BAD_LINES)]
    write_lines(tmp_path / "igaku" / "data" / "2018" / "112-A.jsonl",
                lines + ["", question_line("112A7", answer=("b", "d"))])
    return tmp_path / "igaku"


@pytest.mark.parametrize("line", sorted(BAD_LINES))
def test_malformed_line_error_names_file_line_and_problem(tmp_path: Path, line: int) -> None:
    bad, problem = BAD_LINES[line]
    good = [question_line(f"112A{i}") for i in range(1, line)]
    write_lines(tmp_path / "igaku" / "112-A.jsonl", good + [bad])
    with pytest.raises(DataError) as info:
        load_igakuqa(tmp_path / "igaku")
    message = str(info.value)
    assert f"112-A.jsonl:{line}: " in message
    assert problem in message
    assert info.value.line == line


def test_skip_mode_counts_malformed_lines(tmp_path: Path) -> None:
    dataset = load_igakuqa(malformed_dir(tmp_path), on_malformed="skip")
    assert [q.problem_id for q in dataset.questions] == ["112A1", "112A7"]
    assert dataset.questions[1].answer == ("b", "d")
    block_stats = [s for s in dataset.stats if s.path.endswith("112-A.jsonl")][0]
    assert (block_stats.records, block_stats.skipped) == (2, 5)
    assert any(":3: missing key 'answer'" in p for p in block_stats.problems)


def test_metadata_and_duplicates(tmp_path: Path) -> None:
    root = tmp_path / "igaku"
    write_lines(root / "112-B.jsonl", [question_line("112B1"), question_line("112B2")])
    write_lines(root / "112-B_metadata.jsonl", [
        json.dumps({"problem_id": "112B1", "category": "救急", "kinki": ["Ｃ"]}),
        json.dumps({"problem_id": "112B2", "category": "救急", "kinki": "c"}),
    ])
    with pytest.raises(DataError, match=r"112-B_metadata\.jsonl:2: key 'kinki' must be list"):
        load_igakuqa(root)
    write_lines(root / "112-B_metadata.jsonl", [
        json.dumps({"problem_id": "112B1", "category": "救急", "kinki": ["Ｃ", " de"]})])
    q1, q2 = load_igakuqa(root).questions
    assert (q1.category, q1.kinki, q2.category, q2.kinki) == ("救急", ("c", "d", "e"), "", ())
    write_lines(root / "112-B_metadata.jsonl", [
        json.dumps({"problem_id": "112B1", "kinki": ["c or d"]})])
    with pytest.raises(DataError, match=r"112-B_metadata\.jsonl:1: kinki entry 'c or d'"):
        load_igakuqa(root)
    write_lines(root / "112-B_metadata.jsonl", [])
    write_lines(root / "other" / "112-B.jsonl", [question_line("112B1")])
    with pytest.raises(DataError, match="duplicate problem_id '112B1'"):
        load_igakuqa(root)


def test_two_digit_exams_load_by_year_with_their_metadata(tmp_path: Path) -> None:
    """Exams 95–99 (2001–2005) are numbered with two digits: read, not skipped, zero-padded or not."""
    root = tmp_path / "igaku"
    write_lines(root / "2001" / "95-A.jsonl", [question_line("95A1"), question_line("95A2")])
    write_lines(root / "2001" / "95-A_metadata.jsonl", [json.dumps({"problem_id": "95A1", "category": "救急"})])
    write_lines(root / "2005" / "099-B.jsonl", [question_line("099B1")])
    write_lines(root / "2005" / "099-B_metadata.jsonl", [json.dumps({"problem_id": "099B1", "category": "小児"})])
    write_lines(root / "2018" / "112-A.jsonl", [question_line("112A1")])
    assert load_igakuqa(root).years == [2001, 2005, 2018]
    q1, q2 = load_igakuqa(root, years=[2001]).questions
    assert (q1.exam, q1.year, q1.exam_block, q1.category, q2.problem_id) == (95, 2001, "95-A", "救急", "95A2")
    (q3,) = load_igakuqa(root, years=[2005]).questions
    assert (q3.exam, q3.category) == (99, "小児")


def test_wrong_exam_in_problem_id_and_empty_directory(tmp_path: Path) -> None:
    write_lines(tmp_path / "a" / "112-C.jsonl", [question_line("113C1")])
    with pytest.raises(DataError, match=r"112-C\.jsonl:1: problem_id '113C1'"):
        load_igakuqa(tmp_path / "a")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no IgakuQA block files"):
        load_igakuqa(tmp_path / "empty")


# --- schema ----------------------------------------------------------------------------------

def test_prompt_and_sft_records_round_trip(tmp_path: Path) -> None:
    prompt = PromptRecord(id="x1", source="t", messages=build_messages("問?", ["A", "B"]),
                          answer=["a"], choices=["A", "B"], alternatives=[["b"]],
                          metadata={"kinki": ["b"]})
    sft = SFTRecord(id="x1", source="t", messages=prompt.messages, response="[ans]a[/ans]")
    write_jsonl(tmp_path / "p.jsonl", [prompt])
    write_jsonl(tmp_path / "s.jsonl", [sft])
    assert read_prompts(tmp_path / "p.jsonl") == [prompt]
    assert read_sft(tmp_path / "s.jsonl") == [sft]


@pytest.mark.parametrize("mutate, problem", [
    (lambda o: o.pop("answer"), "missing key 'answer'"),
    (lambda o: o.update(answer=[]), "key 'answer' must not be empty"),
    (lambda o: o.update(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (lambda o: o.update(metadata=[1]), "key 'metadata' must be dict, got list"),
    (lambda o: o.update(id=7), "key 'id' must be str, got int"),
])
def test_prompt_record_validation(tmp_path: Path, mutate: Callable[[dict], object],
                                  problem: str) -> None:
    good = PromptRecord(id="x", source="t", messages=[{"role": "user", "content": "q"}],
                        answer=["a"]).to_dict()
    bad = dict(good)
    mutate(bad)
    path = write_lines(tmp_path / "prompts.jsonl", [json.dumps(good), json.dumps(bad)])
    with pytest.raises(DataError) as info:
        read_prompts(path)
    assert "prompts.jsonl:2:" in str(info.value) and problem in str(info.value)
    stats = ReadStats(str(path))
    assert len(read_prompts(path, on_malformed="skip", stats=stats)) == 1
    assert stats.skipped == 1


def test_non_object_lines_and_invalid_policy(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "x.jsonl", ["[1, 2]"])
    with pytest.raises(DataError, match=r"x\.jsonl:1: expected a JSON object, got list"):
        read_prompts(path)
    with pytest.raises(ValueError, match="on_malformed"):
        read_prompts(path, on_malformed="ignore")


# --- prompts ---------------------------------------------------------------------------------

def test_prompt_instructs_answer_format_and_letters_choices() -> None:
    text = render_question("どれか。", ["甲", "乙", "丙"])
    assert "a. 甲\nb. 乙\nc. 丙" in text
    assert "[ans]a[/ans]" in text and "[ans]a,c[/ans]" in text
    assert "[ans]26[/ans]" in render_question("計算せよ。", [])
    english = render_question("Which?", ["x", "y"], language="en")
    assert "Options:" in english and "[ans]a[/ans]" in english
    with pytest.raises(ValueError):
        render_question("?", ["x"], language="fr")  # type: ignore[arg-type]


def test_format_prompt_fallback_and_chat_template() -> None:
    messages = build_messages("どれか。", ["甲"], system_prompt="SYS")
    text = format_prompt(messages)
    assert text.startswith("### System:\nSYS\n\n### User:\n")
    assert text.endswith("### Assistant:\n")
    assert build_messages("q", ["x"], system_prompt="")[0]["role"] == "user"

    class FakeTokenizer:
        def apply_chat_template(self, msgs: list[dict[str, str]], add_generation_prompt: bool,
                                tokenize: bool) -> str:
            assert add_generation_prompt is True and tokenize is False
            return "|".join(m["role"] for m in msgs) + "|gen"

    assert format_prompt(messages, FakeTokenizer()) == "system|user|gen"


# --- preparation -----------------------------------------------------------------------------

def test_prepare_igakuqa_splits_by_year(tmp_path: Path) -> None:
    result = prepare_igakuqa(FIXTURE, tmp_path, train_years=[2018], eval_years=[2022])
    train = read_prompts(tmp_path / "igakuqa_train.jsonl")
    evaluation = read_prompts(tmp_path / "igakuqa_eval.jsonl")
    sft = read_sft(tmp_path / "igakuqa_sft.jsonl")
    raw = raw_questions()
    raw_2022 = [r for r in raw if r["problem_id"].startswith("116")]
    assert len(evaluation) == len(raw_2022)
    assert {r.metadata["year"] for r in train} == {2018}
    usable = [r for r in raw if r["problem_id"][:3] == "112" and r["choices"]
              and r["points"] != "0"]
    assert len(train) == len(usable) == result.counts["igakuqa_train"]
    assert [s.id for s in sft] == [p.id for p in train]
    for prompt, pair in zip(train, sft, strict=True):
        assert extract_answer(pair.response) == frozenset(prompt.answer)
        assert pair.messages == prompt.messages
    b30 = next(p for p in train if p.id == "112B30")
    assert (b30.answer, b30.alternatives, b30.metadata["kinki"]) == (["a"], [["d"]], ["e"])
    summary = json.loads((tmp_path / "igakuqa_prepare.json").read_text(encoding="utf-8"))
    assert summary["years"] == {"train": [2018], "eval": [2022]}


def test_prepare_igakuqa_rejects_bad_year_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="both training and evaluation"):
        prepare_igakuqa(FIXTURE, tmp_path, train_years=[2018, 2022], eval_years=[2022])
    with pytest.raises(ValueError, match="no IgakuQA data for years \\[2017\\]"):
        prepare_igakuqa(FIXTURE, tmp_path, train_years=[2017])


# --- MedMCQA ---------------------------------------------------------------------------------

def medmcqa_line(qid: str, cop: object, exp: object = "Because.") -> str:
    return json.dumps({"id": qid, "question": "Q?", "opa": "A1", "opb": "B1", "opc": "C1",
                       "opd": "D1", "cop": cop, "exp": exp, "subject_name": "Anatomy",
                       "topic_name": None})


def test_medmcqa_reader_maps_cop_to_letters(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "dev.jsonl", [medmcqa_line(f"q{i}", i) for i in (1, 2, 3, 4)])
    assert [q.answer for q in read_medmcqa(path)] == ["a", "b", "c", "d"]
    zero_based = write_lines(tmp_path / "hf.jsonl", [medmcqa_line("q0", 0), medmcqa_line("q3", 3)])
    assert [q.answer for q in read_medmcqa(zero_based, cop_base=0)] == ["a", "d"]
    with pytest.raises(DataError, match=r"hf\.jsonl:1: key 'cop' must be in 1\.\.4, got 0"):
        read_medmcqa(zero_based)


def test_medmcqa_malformed_lines_and_skip(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "train.jsonl", [
        medmcqa_line("q1", 2), medmcqa_line("q2", "2"), "{not json", medmcqa_line("q4", 5),
        medmcqa_line("q5", 1, exp=None)])
    with pytest.raises(DataError, match=r"train\.jsonl:2: key 'cop' must be int, got str"):
        read_medmcqa(path)
    stats = ReadStats(str(path))
    questions = read_medmcqa(path, on_malformed="skip", stats=stats)
    assert [q.id for q in questions] == ["q1", "q5"]
    assert (stats.records, stats.skipped) == (2, 3)

    result = prepare_medmcqa(path, tmp_path / "out", split="dev", cop_base=1, on_malformed="skip")
    assert result.skipped_lines == 3
    prompts = read_prompts(tmp_path / "out" / "medmcqa_dev.jsonl")
    sft = read_sft(tmp_path / "out" / "medmcqa_dev_sft.jsonl")
    assert [p.answer for p in prompts] == [["b"], ["a"]]
    assert sft[0].response.startswith("Because.") and sft[0].response.endswith("[ans]b[/ans]")
    assert sft[1].response == "[ans]a[/ans]"
