"""Recipe input the loader used to accept or report badly: duplicate keys, non-finite numbers,
non-UTF-8 files, empty override values, and errors of an override blamed on the base file."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_recipe
from tests.helpers.rollout import REPO

GRPO = REPO / "recipes" / "tiny" / "grpo.yaml"


def _problems(path: Path, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_recipe(path, list(overrides))
    return [str(p) for p in info.value.problems]


def test_a_duplicate_key_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(f"defaults: {GRPO}\ntrainer:\n  lr: 1.0e-3\n  max_steps: 3\n  lr: 5.0\n")
    assert _problems(recipe) == [f"{recipe}:5: trainer.lr: duplicate key (first set at {recipe}:3)"]


@pytest.mark.parametrize("override", ["trainer.lr=.inf", "rollout.temperature=-.inf", "algorithm.clip_eps_high=.inf",
                                      "trainer.lr=.nan"])
def test_non_finite_numbers_are_refused(override: str) -> None:
    (problem,) = _problems(GRPO, override)
    assert problem.startswith(f"override #1 ({override}): ") and "not a finite number" in problem


def test_a_recipe_that_is_not_utf8_names_file_and_line(tmp_path: Path) -> None:
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(f"defaults: {GRPO}\n# caf\xe9\n".encode("latin-1"))
    assert _problems(recipe) == [f"{recipe}:2: not UTF-8 text (byte 0xe9); save the recipe as UTF-8"]


def test_an_empty_override_value_is_refused_not_read_as_null() -> None:
    (problem,) = _problems(GRPO, "trainer.max_steps=")
    assert "has no value" in problem and "trainer.max_steps=null" in problem
    assert load_recipe(GRPO, ["trainer.max_steps=null"]).trainer.max_steps is None


def test_errors_of_an_override_are_blamed_on_the_override() -> None:
    problems = _problems(GRPO, "trainer.lr.x=1", "rewards.weights.mcq_answer=true")
    assert problems == [
        "override #1 (trainer.lr.x=1): trainer.lr: got {'x': 1} (dict); expected float",
        "override #2 (rewards.weights.mcq_answer=true): rewards.weights.mcq_answer: got True (bool); expected float"]
