"""`data generate chord-sft`'s logic without a server: the prompt files (checked, editable), the two
stages (part k sees parts 1..k−1), the resumable output (a torn last line is cut and written again,
a resumed run writes no row twice), and `data prepare chord-sft --parts 5` reading the output as it
is. The generation itself is a deterministic stand-in here (tests/e2e/test_generate_chord_sft.py
runs the command on the tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.data.prepare import prepare_chord_sft
from megatron_rl.data.resumable import ResumableJsonl
from megatron_rl.data.schema import DataError, PromptRecord
from megatron_rl.rollout.expert_texts import DEFAULT_PROMPTS, generate_expert_texts, load_prompts, mcq_fields
from megatron_rl.tasks.mcq.prompts import build_messages


def record(i: int) -> PromptRecord:
    choices = ["右冠動脈", "左前下行枝", "左回旋枝"]
    return PromptRecord(id=f"q{i}", source="igakuqa", messages=build_messages(f"問題{i}の文", choices),
                        answer=["a"], choices=choices)


class Model:
    """Answers each turn with a text that names what it was asked (or nothing, for `empty`)."""

    def __init__(self, empty: frozenset[str] = frozenset()) -> None:
        self.turns: list[str] = []
        self.empty = empty

    def __call__(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        out = []
        for messages in conversations:
            text = messages[-1]["content"]
            self.turns.append(text)
            asked = next((line for line in text.splitlines() if line.startswith("次の部分")), "質問文")
            out.append("" if any(e in text for e in self.empty) else f"回答: {asked[:12]} ({len(self.turns)})")
        return out


def test_the_shipped_prompts_have_five_parts_and_their_fields() -> None:
    prompts = load_prompts()
    assert [t for t, _ in prompts.parts] == ["概要", "症状・所見", "対応", "受診の目安", "注意点"]
    assert "{mcq}" in prompts.question and "{previous}" in prompts.answer
    assert (DEFAULT_PROMPTS / "README.md").is_file()


@pytest.mark.parametrize("name, text, problem", [
    ("question.txt", "{mcq} {gold}", "unknown fields ['gold']"),
    ("question.txt", "{answer}", "must use ['{mcq}']"),
    ("answer.txt", "{question} {title", "not a template"),
    ("parts.txt", "# comment\n概要 no tab here\n", "parts.txt:2: a part is 'title<TAB>instruction'"),
])
def test_a_bad_prompt_file_is_named(name: str, text: str, problem: str, tmp_path: Path) -> None:
    for file in ("question.txt", "answer.txt", "parts.txt"):
        (tmp_path / file).write_text((DEFAULT_PROMPTS / file).read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(DataError) as info:
        load_prompts(tmp_path)
    assert problem in str(info.value) and name in str(info.value)


def test_mcq_fields_drop_the_answer_format_and_name_the_gold() -> None:
    fields = mcq_fields(record(1))
    assert fields["mcq"].startswith("問題: 問題1の文") and "c. 左回旋枝" in fields["mcq"]
    assert "[ans]" not in fields["mcq"]
    assert fields["answer"] == "a. 右冠動脈"


def test_two_stages_each_part_sees_the_ones_before(tmp_path: Path) -> None:
    model, out = Model(), tmp_path / "texts.jsonl"
    result = generate_expert_texts([record(1)], out, load_prompts(), model, model="m", progress=None)
    assert result.written == 1 and result.empty == []
    (row,) = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert row["question"] == "回答: 質問文 (1)"                                  # stage 1's output
    assert [s["title"] for s in row["sections"]] == ["概要", "症状・所見", "対応", "受診の目安", "注意点"]
    assert len(model.turns) == 6 and "正解: a. 右冠動脈" in model.turns[0]
    assert "質問: 回答: 質問文 (1)" in model.turns[1] and "（まだありません）" in model.turns[1]
    assert "【概要】\n" + row["sections"][0]["text"] in model.turns[2]              # part 2 sees part 1
    assert "【対応】" in model.turns[5] and "「注意点」" in model.turns[5]
    assert row["metadata"] == {"from": "igakuqa", "answer": ["a"], "model": "m"}
    result = prepare_chord_sft(out, tmp_path / "sft", parts=5)                      # read unchanged
    assert result.counts["chord_sft"] == 1


def test_a_resumed_run_writes_each_row_once_and_redoes_a_torn_one(tmp_path: Path) -> None:
    out = tmp_path / "texts.jsonl"
    records = [record(i) for i in range(5)]
    first = generate_expert_texts(records[:3], out, load_prompts(), Model(), batch_size=2, progress=None)
    assert first.written == 3
    kept = out.read_bytes()
    torn = b'{"id": "q3", "question": "cut here'
    out.write_bytes(kept + torn)                                               # a crash mid-write
    second = generate_expert_texts(records, out, load_prompts(), Model(empty=frozenset({"問題4の文"})),
                                   batch_size=2, progress=None)
    assert (second.already_done, second.written, second.empty, second.torn_bytes) == (3, 1, ["q4"], len(torn))
    assert out.read_bytes().startswith(kept)                                   # written rows unchanged
    ids = [json.loads(line)["id"] for line in out.read_text(encoding="utf-8").splitlines()]
    assert ids == ["q0", "q1", "q2", "q3"]
    third = generate_expert_texts(records, out, load_prompts(), Model(), progress=None)
    assert (third.already_done, third.written) == (4, 1)                      # the empty one, retried
    assert [json.loads(line)["id"] for line in out.read_text(encoding="utf-8").splitlines()][-1] == "q4"


def test_an_output_that_is_not_this_command_s_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "other.jsonl"
    out.write_text('{"id": "a"}\n{"problem_id": "b"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"other\.jsonl:2: not a row of this output"):
        ResumableJsonl(out)
    out.write_text('{"id": "a"}\n{"id": "a"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"other\.jsonl:2: id 'a' appears twice"):
        ResumableJsonl(out)
