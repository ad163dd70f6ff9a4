"""Every recipe key reaches the code or is refused, and the memory keys change what megatron-core
builds (recompute, distributed optimizer, CPU offload, overlap)."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_recipe
from megatron_rl.config.schema import RecipeConfig, TrainerConfig, spec
from tests.mp.launch import REPO

PACKAGE = REPO / "megatron_rl"

# What only checks or plans a recipe does not count as reading it.
NOT_CONSUMERS = ("config/", "planner/", "commands/plan.py")

# Fields that only the planner or the launcher may read, each with the reviewed reason. Empty: every
# field is read by the trainer or the launcher (slurm/render.py, commands/) or refused by the loader.
PLANNER_OR_LAUNCHER_ONLY: dict[str, str] = {}

def consumer_attribute_names(root: Path = PACKAGE) -> set[str]:
    """Every attribute name read anywhere in the trainer/launcher code."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        if str(path.relative_to(root)).startswith(NOT_CONSUMERS):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
    return names

def schema_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every leaf field of the recipe schema."""
    out: list[tuple[str, dataclasses.Field]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += schema_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, f))
    return out

def unread_fields(cls: type, read: set[str]) -> list[str]:
    """Keys that are neither read by a consumer, refused by the loader, nor on the reviewed list.

    A field counts as read when its name is read as an attribute somewhere in the consumers: a
    name-level check (it cannot tell `rollout.n` from another `.n`), strict enough to catch a
    field nobody reads."""
    return [key for key, f in schema_fields(cls)
            if f.name not in read and "not_implemented" not in f.metadata and key not in PLANNER_OR_LAUNCHER_ONLY]

def test_every_recipe_key_is_read_or_refused() -> None:
    assert unread_fields(RecipeConfig, consumer_attribute_names()) == []
    assert len(schema_fields(RecipeConfig)) > 100          # the walk reached every section

def test_a_new_unread_key_is_caught() -> None:
    trainer = dataclasses.make_dataclass("TrainerWithNewKey", [("frobnicate_every", int, spec(3, ge=1))],
                                         bases=(TrainerConfig,))
    recipe = dataclasses.make_dataclass("RecipeWithNewKey", [("trainer", trainer, spec(factory=trainer))],
                                        bases=(RecipeConfig,))
    read = consumer_attribute_names()
    assert set(unread_fields(recipe, read)) - set(unread_fields(RecipeConfig, read)) == {"trainer.frobnicate_every"}

@pytest.mark.parametrize(("key", "value", "default", "reason"), [
    ("parallelism.virtual_pipeline_model_parallel_size", "2", "null", "one model chunk per pipeline rank"),
    ("parallelism.context_parallel_size", "2", "1", "does not split sequences across ranks"),
    ("checkpoint.async_save", "true", "false", "written synchronously"),
])
def test_unimplemented_keys_are_refused_with_the_reason(key: str, value: str, default: str, reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_recipe(REPO / "recipes/tiny/grpo.yaml", [f"{key}={value}"])
    (problem,) = err.value.problems
    assert problem.key == key and "override #1" in problem.where
    assert "not supported yet" in problem.message and reason in problem.message
    assert problem.message.endswith(f"allowed: {default}")
    load_recipe(REPO / "recipes/tiny/grpo.yaml", [f"{key}={default}"])       # the default still loads



# ------------------------------------------------------------------ names the schema accepts
def _choices(cls: type, name: str) -> set[str]:
    return set(typing.get_args(typing.get_type_hints(cls)[name]))

def test_schema_names_are_exactly_the_registries() -> None:
    """The schema lists the choices so that `recipe validate` can check them without importing torch
    (the implementations are tensor code); the registries are the truth, and the lists must equal them."""
    from megatron_rl.advantages import ADVANTAGE_ESTIMATORS
    from megatron_rl.config.schema import AlgorithmConfig, ChordConfig, CorrectionConfig, CorrectionMode
    from megatron_rl.objectives import CORRECTIONS, KL_ESTIMATORS, available_aggregations, available_objectives

    assert _choices(AlgorithmConfig, "name") == set(available_objectives())
    assert _choices(ChordConfig, "rl_objective") == set(available_objectives()) - {"chord"}
    assert _choices(AlgorithmConfig, "loss_agg_mode") == set(available_aggregations())
    assert _choices(ChordConfig, "sft_loss_agg_mode") == set(available_aggregations())
    assert _choices(AlgorithmConfig, "kl_estimator") == set(KL_ESTIMATORS.names())
    # 'auto' is no correction of its own: the recipe resolves it to one (`RecipeConfig.correction_mode`).
    assert _choices(CorrectionConfig, "mode") == set(CORRECTIONS.names()) | {"auto"}
    assert set(typing.get_args(CorrectionMode)) == set(CORRECTIONS.names())
    assert _choices(AlgorithmConfig, "advantage") == set(ADVANTAGE_ESTIMATORS.names())
