"""Config keys a config.json leaves out are read as transformers reads them.

For each architecture, transformers builds its config object from a config.json holding only the
architecture (and once with the keys the released configs set, for the alias paths); every key
our reader fills in is compared with the attribute transformers ends up with. Then the Megatron
model and weight map built from such a sparse config are checked for the values that follow
(query groups, head size, routing normalisation, RoPE base, dense layers).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.model_config import HF_DEFAULTS, head_dim, moe_layers, rope_theta, with_hf_defaults
from megatron_rl.models import planner_shape, weight_map
from megatron_rl.planner.params import read_dims

MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen3NextForCausalLM": "qwen3_next"}
# What a config.json may say instead of the field transformers keeps (transformers 5 renames).
ATTRIBUTE = {"num_experts": ("num_experts", "num_local_experts")}


def _transformers_config(fields: dict[str, Any], tmp_path: Path) -> Any:
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(fields))
    return AutoConfig.from_pretrained(tmp_path)


def _attribute(config: Any, key: str) -> Any:
    for name in ATTRIBUTE.get(key, (key,)):
        if hasattr(config, name):
            return getattr(config, name)
    if key == "full_attention_interval":      # kept only as the layer_types it expands into
        types = config.layer_types
        return next(i + 1 for i, t in enumerate(types) if t == "full_attention")
    if key == "partial_rotary_factor":
        return config.rope_parameters["partial_rotary_factor"]
    raise AssertionError(f"transformers' {type(config).__name__} has no {key!r}")


@pytest.mark.parametrize("arch", list(HF_DEFAULTS))
def test_every_default_equals_transformers(arch: str, tmp_path: Path) -> None:
    sparse = {"architectures": [arch], "model_type": MODEL_TYPES[arch]}
    ours = with_hf_defaults(sparse)
    theirs = _transformers_config(sparse, tmp_path)
    assert set(ours) - set(sparse) == set(HF_DEFAULTS[arch])
    for key in HF_DEFAULTS[arch]:
        assert ours[key] == _attribute(theirs, key), f"{arch}.{key}: ours {ours[key]!r}"
    assert rope_theta(ours) == theirs.rope_parameters["rope_theta"]
    assert head_dim(ours) == getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)


def test_given_keys_win_and_aliases_count(tmp_path: Path) -> None:
    fields = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_local_experts": 6,
              "num_key_value_heads": 2, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
              "rope_theta": 1e6, "norm_topk_prob": True}
    ours = with_hf_defaults(fields)
    theirs = _transformers_config(fields, tmp_path)
    assert "num_experts" not in ours and theirs.num_experts == 6     # the alias is not overridden
    assert ours["num_key_value_heads"] == theirs.num_key_value_heads == 2
    assert rope_theta(ours) == theirs.rope_parameters["rope_theta"] == 5e5   # rope_parameters first
    dense = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_key_value_heads": None,
             "num_attention_heads": 8}
    assert with_hf_defaults(dense)["num_key_value_heads"] == _transformers_config(dense, tmp_path).num_key_value_heads


def test_layer_pattern_is_transformers(tmp_path: Path) -> None:
    """`moe_layers` (provider, weight map, planner) against transformers' own decoder layers."""
    import torch
    from transformers import AutoModelForCausalLM

    fields = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 6,
              "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
              "decoder_sparse_step": 2, "mlp_only_layers": [3], "vocab_size": 64}
    model = AutoModelForCausalLM.from_config(_transformers_config(fields, tmp_path), dtype=torch.float32)
    theirs = [hasattr(layer.mlp, "gate") and not hasattr(layer.mlp, "gate_proj") for layer in model.model.layers]
    assert moe_layers(fields) == theirs == [False, True, False, False, False, True]
    hf = with_hf_defaults(fields)
    mapped = {e.layer for e in weight_map(fields).entries if e.mcore.endswith("router.weight")}
    assert mapped == {i for i, moe in enumerate(theirs) if moe}
    dims = read_dims(fields, planner_shape(fields))
    from megatron_rl.planner.params import is_moe_layer

    assert [is_moe_layer(dims, i) for i in range(hf["num_hidden_layers"])] == theirs


_PROVIDER_PROBE = """
import json, sys, torch
from megatron_rl.megatron import cpu_compat
cpu_compat.apply()
from megatron_rl.config.schema import ParallelismConfig
from megatron_rl.models import build_model
recipe = build_model(json.loads(sys.argv[1]), ParallelismConfig(), torch.float32)
c = recipe.config
print(json.dumps(dict(groups=c.num_query_groups, kv=c.kv_channels, pre_softmax=c.moe_router_pre_softmax,
                      freq=c.moe_layer_freq, base=recipe.rotary_base, eps=c.layernorm_epsilon,
                      tied=recipe.tie_word_embeddings, max_len=recipe.max_sequence_length,
                      rotary=recipe.rotary_percent)))
"""


@pytest.mark.parametrize("arch", list(HF_DEFAULTS))
def test_provider_reads_sparse_configs_like_transformers(arch: str, tmp_path: Path) -> None:
    """The provider (in a subprocess: it patches megatron for CPU) on a config with only the sizes."""
    sizes = {"architectures": [arch], "model_type": MODEL_TYPES[arch], "num_hidden_layers": 2, "hidden_size": 64,
             "num_attention_heads": 8, "vocab_size": 128}
    if arch != "Qwen3ForCausalLM":
        sizes.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    theirs = _transformers_config(sizes, tmp_path)
    out = subprocess.run([sys.executable, "-c", _PROVIDER_PROBE, json.dumps(sizes)], capture_output=True,
                         text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["groups"] == theirs.num_key_value_heads
    assert got["kv"] == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    assert got["base"] == theirs.rope_parameters["rope_theta"]
    assert got["eps"] == theirs.rms_norm_eps and got["tied"] == theirs.tie_word_embeddings
    assert got["max_len"] == theirs.max_position_embeddings
    if arch != "Qwen3ForCausalLM":
        assert got["pre_softmax"] is (not theirs.norm_topk_prob)
        assert got["freq"] == [1, 1]
    if arch == "Qwen3NextForCausalLM":
        assert got["rotary"] == theirs.rope_parameters["partial_rotary_factor"]
