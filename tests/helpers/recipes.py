"""Recipes built by hand in tests (no YAML): the schema's sections from keyword arguments."""

from __future__ import annotations

from typing import Any

from megatron_rl.config.schema import (
    AlgorithmConfig,
    ModelConfig,
    ParallelismConfig,
    RecipeConfig,
    RolloutConfig,
    TrainerConfig,
)


def hand_recipe(hf: dict[str, Any], **sections: Any) -> RecipeConfig:
    return RecipeConfig(name="hand", model=ModelConfig(tiny=hf, **sections.pop("model", {})),
                        parallelism=ParallelismConfig(**sections.pop("parallelism", {})),
                        rollout=RolloutConfig(**sections.pop("rollout", {})),
                        trainer=TrainerConfig(**sections.pop("trainer", {})),
                        algorithm=AlgorithmConfig(**sections.pop("algorithm", {})))
