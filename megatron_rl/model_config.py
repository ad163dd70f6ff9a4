"""The HF `config.json` of a recipe's model, as plain data (no transformers import).

Used by the lint rules (heads/experts/layers divisibility), the planner (parameter counts) and,
later, the Megatron model providers. A recipe names the architecture either by `model.hf_config`
(a directory or a config.json) or, for tiny CPU recipes, by `model.tiny` (the fields themselves).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config.schema import ModelConfig


class ModelConfigError(ValueError):
    """The model's config.json is missing or unreadable."""


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Read `path` (a model directory or its config.json)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ModelConfigError(f"model config not found: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{p}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{p}: a config.json must be a JSON object")
    return data


def resolve_hf_config(model: ModelConfig) -> dict[str, Any] | None:
    """The model's HF config: `model.tiny` if given, else `model.hf_config` read from disk.

    Returns None when the recipe names neither.
    """
    if model.tiny:
        return dict(model.tiny)
    if model.hf_config is None:
        return None
    return read_hf_config(model.hf_config)


def num_experts(hf: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0 for dense models).

    Public Qwen3 configs say `num_experts`; transformers 5 writes `num_local_experts`.
    """
    return int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)


def rope_theta(hf: dict[str, Any]) -> float:
    """RoPE base: `rope_theta` (public configs) or `rope_parameters.rope_theta` (transformers 5);
    transformers' `default_theta` when neither is given."""
    rope = rope_parameters(hf)
    for value in (rope.get("rope_theta"), hf.get("rope_theta")):      # transformers' priority
        if value is not None:
            return float(value)
    return DEFAULT_ROPE_THETA


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict as transformers picks it: `rope_scaling`, else `rope_parameters`."""
    return dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})


def head_dim(hf: dict[str, Any]) -> int:
    """Explicit `head_dim`, else hidden / heads (Qwen3-MoE's modeling code; the other two
    architectures get their transformers default from `with_hf_defaults`)."""
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


DEFAULT_ROPE_THETA = 10_000.0
"""transformers' `RotaryEmbeddingConfigMixin.default_theta`."""

_QWEN3_COMMON: dict[str, Any] = {
    "vocab_size": 151936, "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "max_position_embeddings": 32768,
}
_MOE_COMMON: dict[str, Any] = {"decoder_sparse_step": 1, "mlp_only_layers": []}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    # transformers 5.19 configuration_qwen3.py
    "Qwen3ForCausalLM": {**_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 22016,
                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                         "head_dim": 128},
    # configuration_qwen3_moe.py (no head_dim field: the modeling code uses hidden / heads)
    "Qwen3MoeForCausalLM": {**_QWEN3_COMMON, **_MOE_COMMON, "hidden_size": 2048, "intermediate_size": 6144,
                            "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                            "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
                            "norm_topk_prob": False},
    # configuration_qwen3_next.py
    "Qwen3NextForCausalLM": {**_QWEN3_COMMON, **_MOE_COMMON, "hidden_size": 2048, "intermediate_size": 5632,
                             "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                             "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                             "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                             "linear_num_value_heads": 32, "moe_intermediate_size": 512,
                             "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
                             "num_experts": 512, "norm_topk_prob": True, "full_attention_interval": 4,
                             "partial_rotary_factor": 0.25},
}
"""Per architecture, what transformers assumes for a key that `config.json` leaves out. Every key
the providers, weight maps and planner read is here or required; tests/unit/test_model_defaults.py
builds the transformers config objects and compares field by field."""
_MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
_EXPERT_ALIASES = ("num_experts", "num_local_experts", "n_routed_experts")


def with_hf_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` with every absent (or null) key its architecture reads filled in as transformers would.

    Unknown architectures come back unchanged (the registries refuse them with the supported list).
    """
    archs = list(hf.get("architectures") or []) + [_MODEL_TYPES.get(str(hf.get("model_type")), "")]
    defaults = HF_DEFAULTS.get(archs[0]) or HF_DEFAULTS.get(archs[-1])
    if defaults is None:
        return dict(hf)
    out = dict(hf)
    for key, value in defaults.items():
        if key == "num_experts" and any(out.get(k) is not None for k in _EXPERT_ALIASES):
            continue
        if out.get(key) is None:
            out[key] = list(value) if isinstance(value, list) else value
    if hf.get("num_key_value_heads", 0) is None:       # Qwen3Config: explicit null means MHA
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def moe_layers(hf: dict[str, Any]) -> list[bool]:
    """Per layer: does it have routed experts? The one definition (transformers' Qwen3-MoE and
    Qwen3-Next decoder layers): MoE when the model has experts, the layer is not in
    `mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step`; otherwise a dense SwiGLU
    MLP. Used by the provider (Megatron's `moe_layer_freq` and layer specs), the weight map and the
    planner."""
    if not num_experts(hf):
        return [False] * int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in hf.get("mlp_only_layers") or []}
    return [(i + 1) % step == 0 and i not in dense for i in range(int(hf["num_hidden_layers"]))]


MEGATRON_COMPLETE = "complete.json"      # = megatron.checkpoint.COMPLETE (not imported: that pulls megatron)
CONVERTED_HF_SUBDIR = "hf"               # = convert.worker.HF_SUBDIR: config + tokenizer of a conversion


@dataclass(frozen=True)
class InitCheckpoint:
    """Where the policy's starting weights come from: an HF directory or a Megatron dist-checkpoint
    (e.g. the output of `megatron-rl convert hf-to-mcore`, saved at any parallel layout)."""

    path: str
    megatron: bool
    hf_dir: str
    """The HF config and tokenizer files: the HF checkpoint itself, a converted dist-checkpoint's
    `hf/` directory, or (for other dist-checkpoints) the directory of `model.hf_config`."""

    @property
    def server_args(self) -> list[str]:
        """vLLM cannot read a dist-checkpoint: it starts from random weights of the right shapes,
        and the trainer syncs its own before the first rollout (and after every restart)."""
        return ["--load-format", "dummy"] if self.megatron else []


def is_megatron_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MEGATRON_COMPLETE).is_file()


def init_checkpoint(model: ModelConfig, path: str | None = None) -> InitCheckpoint:
    """`path` (default: `model.init_checkpoint`) as an HF directory or a Megatron dist-checkpoint."""
    path = path or model.init_checkpoint
    if not path:
        raise ModelConfigError("model.init_checkpoint is not set (an HF directory or a Megatron dist-checkpoint)")
    if not is_megatron_checkpoint(path):
        return InitCheckpoint(path, False, path)
    side = Path(path) / CONVERTED_HF_SUBDIR
    if (side / "config.json").is_file():
        return InitCheckpoint(path, True, str(side))
    if model.hf_config:
        hf = Path(model.hf_config)
        return InitCheckpoint(path, True, str(hf if hf.is_dir() else hf.parent))
    raise ModelConfigError(f"{path}: a Megatron dist-checkpoint without {CONVERTED_HF_SUBDIR}/config.json "
                           "(not written by `convert hf-to-mcore`); set model.hf_config and model.tokenizer")
