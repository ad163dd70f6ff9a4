"""The model registry: one folder per architecture, each exporting one `SPEC` (`spec.ModelSpec`).

A folder holds everything its architecture needs:
- `__init__.py`: its `SPEC`, torch-free: planner shapes, HF model types, the layer pattern, and
  lazy callables for the two parts below;
- `provider.py`: the Megatron-core model built from the HF config (imports megatron-core, from the
  building blocks of `megatron/gpt.py`);
- `weights.py`: the HF ↔ Megatron weight map (from the building blocks of `weights/map.py`).

Everyone else asks this module: `build_model`, `weight_map`, `planner_shape`, `layer_types`.
It sits above `megatron/` and `weights/`, which never import a folder, and imports the folders
themselves only by name (`MODELS`), so the planner stays torch-free. Adding a model is one folder
plus one line in `MODELS` (see the README, "Adding a model").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..model_config import with_hf_defaults
from ..registry import Registry
from .model_spec import ModelSpec, PlannerShape

if TYPE_CHECKING:
    import torch

    from ..config.schema import ParallelismConfig
    from ..megatron.gpt import ModelRecipe
    from ..weights.map import WeightAdapter

MODELS: Registry[str] = Registry("model architecture", {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    "Qwen3NextForCausalLM": "qwen3_next",
})
"""HF `architectures[0]` → its folder."""


class UnknownArchitecture(ValueError):
    """A config whose architecture no folder builds; `named` is what it names (None: nothing)."""

    def __init__(self, named: str | None, supported: list[str]) -> None:
        self.named, self.supported = named, supported
        super().__init__("the model config has no 'architectures' entry" if named is None else
                         f"unsupported architecture {named!r}; supported: {', '.join(supported)}")


def folder_spec(folder: str) -> ModelSpec:
    """The `SPEC` of `megatron_rl/models/<folder>/` (imports only its torch-free `__init__`)."""
    spec = importlib.import_module(f"{__name__}.{folder}").SPEC
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"{__name__}.{folder}.SPEC is a {type(spec).__name__}, not a ModelSpec")
    return spec


def specs() -> list[ModelSpec]:
    """Every folder's spec, once each (folders in the order of their first architecture's name)."""
    return [folder_spec(folder) for folder in dict.fromkeys(f for _, f in MODELS.items())]


def architecture(hf: dict[str, Any]) -> str:
    """The registered architecture `hf` describes: the first of its `architectures` the registry
    knows, else the one its `model_type` names; `UnknownArchitecture` otherwise."""
    names = list(hf.get("architectures") or [])
    for name in names:
        if name in MODELS:
            return name
    model_type = hf.get("model_type")
    for spec in specs():
        if model_type in spec.model_types:
            return spec.model_types[str(model_type)]
    raise UnknownArchitecture(names[0] if names else model_type, MODELS.names())


def spec(hf: dict[str, Any]) -> ModelSpec:
    """The spec of the folder that builds `hf`'s architecture."""
    return folder_spec(MODELS.get(architecture(hf)))


def build_model(hf: dict[str, Any], layout: ParallelismConfig, dtype: torch.dtype) -> ModelRecipe:
    """The Megatron model of `hf` (its absent keys read with transformers' defaults) at `layout`.
    Imports megatron-core: the entry point must have called `megatron.cpu_compat.apply()`."""
    arch = architecture(hf)
    return folder_spec(MODELS.get(arch)).build(arch, with_hf_defaults(hf), layout, dtype)


def weight_map(hf: dict[str, Any]) -> WeightAdapter:
    """The HF ↔ Megatron weight map of `hf` (absent keys read as transformers would)."""
    return spec(hf).weight_map(with_hf_defaults(hf))


def planner_shape(hf: dict[str, Any]) -> PlannerShape:
    """What the planner counts differently for `hf`'s architecture (torch-free)."""
    return spec(hf).shapes[architecture(hf)]


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's token mixer, 'full_attention' or 'linear_attention' (torch-free)."""
    return spec(hf).layer_types(with_hf_defaults(hf))
