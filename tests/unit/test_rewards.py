"""Rule-based rewards: MCQ answer parsing, prohibited choices, language, MedMCQA, registry, and
behaviour on hostile (huge or pathological) responses."""

from __future__ import annotations

import random

import pytest

from megatron_rl.data.schema import PromptRecord
from megatron_rl.rewards import (
    MAX_TAIL_CHARS,
    UnknownRewardError,
    available_rewards,
    combine,
    get_reward,
    register_reward,
    registry,
)
from megatron_rl.rewards.language import japanese_only
from megatron_rl.tasks.mcq.answer import extract_answer, format_answer, mcq_answer, prohibited_choice
from megatron_rl.tasks.medmcqa.rewards import medmcqa_flexible, medmcqa_strict

SAMPLE_AC = {"answer": ["a", "c"], "metadata": {"kinki": ["e"]}}
BUILTIN = {"mcq_answer", "prohibited_choice", "japanese_only", "medmcqa_strict",
           "medmcqa_flexible"}


def record(answer: list[str], kinki: list[str] | None = None,
           alternatives: list[list[str]] | None = None) -> PromptRecord:
    return PromptRecord(id="q1", source="test", messages=[{"role": "user", "content": "?"}],
                        answer=answer, choices=["1", "2", "3", "4", "5"],
                        alternatives=alternatives or [], metadata={"kinki": kinki or []})


# --- mcq_answer ------------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("考察…よって[ans]a,c[/ans]", 1.0),
    ("[ans]c,a[/ans]", 1.0),
    ("[ans] a , c [/ans]", 1.0),
    ("[ans]a、c[/ans]", 1.0),
    ("[ans]a c[/ans]", 1.0),
    ("[ans]A,C[/ans]", 1.0),
    ("[ANS]a,c[/ANS]", 1.0),
    ("［ａｎｓ］ａ，ｃ［／ａｎｓ］", 1.0),
    ("[ans]Ａ、Ｃ[/ans]", 1.0),
    ("[ans](a), (c).[/ans]", 1.0),
    ("[ans]a[/ans]", 0.0),
    ("[ans]a,c,d[/ans]", 0.0),
    ("[ans]ac[/ans]", 0.0),
    ("[ans]a or c[/ans]", 0.0),
    ("the answer is a and c", 0.0),
    ("[ans]a,c", 0.0),
    ("a,c[/ans]", 0.0),
    ("", 0.0),
])
def test_mcq_answer_multi_answer_set_match(response: str, expected: float) -> None:
    assert mcq_answer(response, SAMPLE_AC) == expected


def test_last_answer_tag_wins() -> None:
    assert mcq_answer("[ans]b[/ans] いや、訂正します。[ans]a,c[/ans]", SAMPLE_AC) == 1.0
    assert mcq_answer("[ans]a,c[/ans] いや、訂正します。[ans]b[/ans]", SAMPLE_AC) == 0.0
    # An unclosed trailing tag does not override the last complete one.
    assert mcq_answer("[ans]a,c[/ans] 念のため [ans]b", SAMPLE_AC) == 1.0


def test_record_and_mapping_samples_agree() -> None:
    rec = record(["a", "c"], kinki=["e"])
    for response in ("[ans]a,c[/ans]", "[ans]a[/ans]", "[ans]e[/ans]", "none"):
        assert mcq_answer(response, rec) == mcq_answer(response, SAMPLE_AC)
        assert prohibited_choice(response, rec) == prohibited_choice(response, SAMPLE_AC)


def test_alternative_gold_sets_are_accepted() -> None:
    rec = record(["a"], alternatives=[["d"]])
    assert mcq_answer("[ans]a[/ans]", rec) == 1.0
    assert mcq_answer("[ans]d[/ans]", rec) == 1.0
    assert mcq_answer("[ans]a,d[/ans]", rec) == 0.0


def test_gold_given_as_comma_string_and_numeric_answers() -> None:
    assert mcq_answer("[ans]c, a[/ans]", {"answer": "a,c"}) == 1.0
    assert mcq_answer("計算すると[ans]26[/ans]", {"answer": ["26"]}) == 1.0
    assert mcq_answer("[ans]２６[/ans]", {"answer": ["26"]}) == 1.0
    assert mcq_answer("[ans]7.2[/ans]", {"answer": ["7.20"]}) == 0.0


def test_sample_without_answer_is_an_error() -> None:
    with pytest.raises(ValueError, match="answer"):
        mcq_answer("[ans]a[/ans]", {"question": "x"})


def test_format_answer_round_trips_through_the_parser() -> None:
    for letters in (["a"], ["c", "a"], ["e", "b", "d"]):
        assert extract_answer("x " + format_answer(letters)) == frozenset(letters)
    assert format_answer(["c", "a"]) == "[ans]a,c[/ans]"


# --- prohibited_choice -----------------------------------------------------------------------

def test_prohibited_choice_penalises_kinki_only() -> None:
    sample = {"answer": ["b"], "metadata": {"kinki": ["e"]}}
    assert prohibited_choice("[ans]e[/ans]", sample) == -1.0
    assert prohibited_choice("[ans]b,e[/ans]", sample) == -1.0
    assert prohibited_choice("[ans]Ｅ[/ans]", sample) == -1.0
    assert prohibited_choice("[ans]b[/ans]", sample) == 0.0
    assert prohibited_choice("e を選ぶのは禁忌", sample) == 0.0  # no parseable answer
    assert prohibited_choice("[ans]e[/ans]", {"answer": ["b"]}) == 0.0  # no kinki listed
    assert prohibited_choice("[ans]e[/ans]", sample, penalty=-2.5) == -2.5
    assert prohibited_choice("[ans]e[/ans]", {"answer": ["b"], "kinki": ["e"]}) == -1.0


# --- japanese_only ---------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("これは日本語の回答です。診断は心筋梗塞です。[ans]a[/ans]", 1.0),
    ("This is English。It continues in English。[ans]a[/ans]", 0.0),
    ("まず考えます。This sentence is English。次は日本語です。", 1.0),
    ("まず考えます。First English sentence。Second English sentence。", 0.0),
    ("英語の後に空文。English one。 。 。English two。", 0.0),
    ("カタカナだけ。ABC。デス。XYZ。", 1.0),
    ("ﾊﾝｶｸｶﾅ。ABC。ﾃﾞｽ。", 1.0),
    ("", 1.0),
    ("よって答えは次の通り。[ans]a[/ans]。[ans]b[/ans]。", 1.0),
    # ー and ・ are not kana letters: Chinese sentences containing them are still kana-free.
    ("维生素B・C缺乏。治疗是补充维生素", 0.0),
    ("使用胰岛素ー治疗。血糖控制良好", 0.0),
    ("使用胰岛素ｰ治疗。血糖控制･良好", 0.0),
    ("コーヒーを控える。ビタミンB・C欠乏。", 1.0),
    ("ㇰㇱ。ABC。ｱｲ。", 1.0),
])
def test_japanese_only(response: str, expected: float) -> None:
    assert japanese_only(response, {}) == expected


# --- MedMCQA ---------------------------------------------------------------------------------

MED = {"answer": ["b"]}


@pytest.mark.parametrize("response, strict, flexible", [
    ("Reasoning... [ans]b[/ans]", 1.0, 1.0),
    ("The correct answer is B.", 1.0, 1.0),
    ("Final Answer: (b)", 1.0, 1.0),
    ("Answer: b", 1.0, 1.0),
    ("答え：Ｂ", 1.0, 1.0),
    ("正解はB", 1.0, 1.0),
    ("Answer: C", 0.1, 0.1),
    ("[ans]a,b[/ans]", 0.1, 0.1),
    ("The answer is B", 0.0, 1.0),
    ("I would pick option B here", 0.0, 1.0),
    ("Long reasoning.\nB", 0.0, 1.0),
    ("Long reasoning.\n(c)\n", 0.0, 0.1),
    ("the answer is a fracture of the femur", 0.0, 0.0),
    ("No idea.", 0.0, 0.0),
    ("Answer: E", 0.0, 0.0),
])
def test_medmcqa_strict_and_flexible(response: str, strict: float, flexible: float) -> None:
    assert medmcqa_strict(response, MED) == strict
    assert medmcqa_flexible(response, MED) == flexible


@pytest.mark.parametrize("response, expected", [
    ("Answer: a patient with anemia would", None),   # published reward: A
    ("This is also a cause of bleeding.", None),      # published reward: A ("so a" in "also a")
    ("The correct answer is B. Then again, Answer: C", "b"),  # published: C (pattern order)
    ("答え: A\nAnswer: B", "b"),                       # published: A (答え: ranks first)
    ("Answer: B" + " filler" * 60, "b"),              # published: none (300-char window)
    ("[ans]b[/ans]", "b"),                             # published: none (no tag pattern)
])
def test_medmcqa_differs_from_the_published_extractor_as_documented(
        response: str, expected: str | None) -> None:
    from megatron_rl.tasks.medmcqa.rewards import extract_medmcqa_answer

    got = extract_medmcqa_answer(response, flexible=False)
    assert got == (None if expected is None else frozenset({expected}))


def test_medmcqa_reward_uses_each_completions_own_gold() -> None:
    # The published reward took gold by batch position; here the score follows the sample.
    samples = [{"answer": [g]} for g in "abcd"]
    responses = [f"Answer: {g.upper()}" for g in "abcd"]
    forward = [medmcqa_strict(r, s) for r, s in zip(responses, samples, strict=True)]
    backward = [medmcqa_strict(r, s) for r, s in zip(responses[::-1], samples[::-1], strict=True)]
    assert forward == backward[::-1] == [1.0] * 4


def test_medmcqa_priority_and_last_match() -> None:
    # The [ans] tag outranks a later "Answer:" line; within one pattern the last match wins.
    assert medmcqa_strict("[ans]b[/ans]\nAnswer: C", MED) == 1.0
    assert medmcqa_strict("Answer: C ... on reflection, Answer: B", MED) == 1.0
    assert medmcqa_strict("Answer: B ... on reflection, Answer: C", MED) == 0.1


# --- registry --------------------------------------------------------------------------------

def test_registry_lists_builtins_and_rejects_unknown_names() -> None:
    assert BUILTIN <= set(available_rewards())
    assert get_reward("mcq_answer") is mcq_answer
    with pytest.raises(UnknownRewardError) as info:
        get_reward("mcq_answr")
    message = str(info.value)
    assert "mcq_answr" in message
    for name in BUILTIN:
        assert name in message


def test_register_reward_and_duplicate_names() -> None:
    try:
        @register_reward("test_length_bonus")
        def length_bonus(response: str, sample: object) -> float:
            return min(len(response), 10) / 10

        assert get_reward("test_length_bonus")("abcde", {}) == 0.5
        with pytest.raises(ValueError, match="already registered"):
            register_reward("test_length_bonus")(lambda response, sample: 0.0)
    finally:
        registry.REWARDS._items.pop("test_length_bonus", None)
    assert "test_length_bonus" not in available_rewards()


def test_combine_weights_rewards() -> None:
    response = "[ans]e[/ans]"
    sample = {"answer": ["e"], "metadata": {"kinki": ["e"]}}
    total, per_name = combine({"mcq_answer": 1.0, "prohibited_choice": 0.5,
                               "japanese_only": 0.25}, response, sample)
    assert per_name == {"mcq_answer": 1.0, "prohibited_choice": -1.0, "japanese_only": 1.0}
    assert total == pytest.approx(1.0 - 0.5 + 0.25)
    with pytest.raises(UnknownRewardError):
        combine({"mcq_answer": 1.0, "nope": 1.0}, response, sample)
    with pytest.raises(ValueError, match="finite"):
        combine({"mcq_answer": float("nan")}, response, sample)


# --- hostile output --------------------------------------------------------------------------

MEGABYTE = 1_000_000
ALL_REWARDS = ("mcq_answer", "prohibited_choice", "japanese_only", "medmcqa_strict",
               "medmcqa_flexible")
ALLOWED_VALUES = {"mcq_answer": {0.0, 1.0}, "prohibited_choice": {0.0, -1.0},
                  "japanese_only": {0.0, 1.0}, "medmcqa_strict": {0.0, 0.1, 1.0},
                  "medmcqa_flexible": {0.0, 0.1, 1.0}}
PIECES = ("[ans]", "[/ans]", "[ans", "ans]", "[/", "a", "b", "c", "e", "A", ",", "、", " ", "\n",
          "。", "あ", "カ", "診断", "answer", "Answer:", "the correct answer is ", "option ", "(",
          ")", "ａ", "［", "］", "z", "7.2", "\t")
HOSTILE: dict[str, str] = {
    "1MB of a": "a" * MEGABYTE,
    "open tags": "[ans]" * 200_000,
    "close tags": "[/ans]" * 200_000,
    "comma run": "a," * 500_000,
    "comma run in a tag": "[ans]" + "a," * 500_000 + "[/ans]",
    "kana without 。": "あ" * MEGABYTE,
    "latin without 。": "x" * MEGABYTE,
    "only 。": "。" * MEGABYTE,
    "spaces after answer": "answer" + " " * MEGABYTE + "B",
    "answer prefixes": "Answer: " * 125_000,
    "correct-answer prefixes": "the correct answer is " * 50_000,
    "nested brackets": "[" * 500_000 + "]" * 500_000,
}
SAMPLE_HOSTILE = {"answer": ["a"], "metadata": {"kinki": ["b"]}}


def _random_text(rng: random.Random, n_pieces: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n_pieces))


def test_hostile_inputs_return_valid_rewards() -> None:
    for name, text in HOSTILE.items():
        for reward in ALL_REWARDS:
            value = get_reward(reward)(text, SAMPLE_HOSTILE)
            assert value in ALLOWED_VALUES[reward], (name, reward, value)
    assert mcq_answer(HOSTILE["open tags"], SAMPLE_HOSTILE) == 0.0
    assert mcq_answer(HOSTILE["comma run in a tag"], SAMPLE_HOSTILE) == 0.0
    assert japanese_only(HOSTILE["kana without 。"], {}) == 1.0
    assert japanese_only(HOSTILE["latin without 。"], {}) == 1.0  # one sentence only
    assert japanese_only(HOSTILE["only 。"], {}) == 1.0


def test_answer_at_the_end_of_a_megabyte_is_found_and_one_beyond_the_tail_is_not() -> None:
    noise = "x" * MEGABYTE
    assert mcq_answer(noise + "[ans]a[/ans]", SAMPLE_HOSTILE) == 1.0
    assert medmcqa_strict(noise + "Answer: a.", SAMPLE_HOSTILE) == 1.0
    # Documented bound: only the last MAX_TAIL_CHARS characters are read.
    assert mcq_answer("[ans]a[/ans]" + "x" * MAX_TAIL_CHARS, SAMPLE_HOSTILE) == 0.0
    assert mcq_answer("[ans]a[/ans]" + "x" * (MAX_TAIL_CHARS - 20), SAMPLE_HOSTILE) == 1.0


def test_random_noise_properties() -> None:
    rng = random.Random(20240611)
    for trial in range(300):
        text = _random_text(rng, rng.choice((10, 200, 3000)))
        for reward in ALL_REWARDS:
            assert get_reward(reward)(text, SAMPLE_HOSTILE) in ALLOWED_VALUES[reward], (trial,
                                                                                      reward)
        # Whatever precedes it, a final canonical tag decides the MCQ reward.
        assert mcq_answer(text + "[ans]a[/ans]", SAMPLE_HOSTILE) == 1.0
        assert mcq_answer(text + "[ans]b[/ans]", SAMPLE_HOSTILE) == 0.0
        assert prohibited_choice(text + "[ans]a,b[/ans]", SAMPLE_HOSTILE) == -1.0


def test_random_megabyte_inputs() -> None:
    rng = random.Random(7)
    for _ in range(3):
        chunk = _random_text(rng, 5_000)
        text = (chunk * (MEGABYTE // max(len(chunk), 1) + 1))[:MEGABYTE]
        for reward in ALL_REWARDS:
            assert get_reward(reward)(text, SAMPLE_HOSTILE) in ALLOWED_VALUES[reward]
        assert mcq_answer(text + "\n[ans]a[/ans]", SAMPLE_HOSTILE) == 1.0
