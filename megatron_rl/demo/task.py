"""A synthetic multiple-choice task in the project's `[ans]…[/ans]` format.

"Which number is the largest/smallest?" over four one-digit choices. Tiny models learn the answer
format quickly from a short supervised warm-up but pick the right letter only part of the time,
which leaves GRPO room to raise the reward.
"""

from __future__ import annotations

import random
from pathlib import Path

from ..data.schema import PromptRecord, SFTRecord, write_jsonl

LETTERS = "abcd"
QUESTIONS = {"largest": max, "smallest": min}


def make_question(rng: random.Random, index: int) -> PromptRecord:
    numbers = rng.sample(range(10), 4)
    kind = rng.choice(sorted(QUESTIONS))
    best = QUESTIONS[kind](numbers)
    answer = LETTERS[numbers.index(best)]
    text = f"Which is the {kind}? " + " ".join(f"{l}) {n}" for l, n in zip(LETTERS, numbers))
    return PromptRecord(id=f"synth-{index}", source="synthetic_mcq",
                        messages=[{"role": "user", "content": text}], answer=[answer],
                        choices=[str(n) for n in numbers], metadata={"kind": kind})


def expert_response(record: PromptRecord) -> str:
    return f"[ans]{record.answer[0]}[/ans]"


def write_task(out_dir: str | Path, n_train: int, n_eval: int, seed: int) -> dict[str, Path]:
    """train/eval prompts and SFT pairs (the expert data CHORD and the warm-up use)."""
    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = [make_question(rng, i) for i in range(n_train)]
    evals = [make_question(rng, n_train + i) for i in range(n_eval)]
    sft = [SFTRecord(id=r.id, source=r.source, messages=r.messages, response=expert_response(r))
           for r in train]
    paths = {"train": out / "train.jsonl", "eval": out / "eval.jsonl", "sft": out / "sft.jsonl"}
    write_jsonl(paths["train"], train)
    write_jsonl(paths["eval"], evals)
    write_jsonl(paths["sft"], sft)
    return paths


def corpus(n: int, seed: int) -> list[str]:
    """Text for training the tokenizer: questions and answers as the chat template renders them."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        r = make_question(rng, i)
        lines.append(r.messages[0]["content"] + " " + expert_response(r))
    return lines
