"""Weight map of Qwen3ForCausalLM (dense) and Qwen3MoeForCausalLM, local (non-TE) spec names."""

from __future__ import annotations

from typing import Any

from ...model_config import head_dim, moe_layers, num_experts
from ...weights.map import Entry, WeightAdapter, cat_rows, qkv_merge, split_rows


def attention_entries(hf: dict[str, Any], i: int, hf_attn: str, mc_attn: str) -> list[Entry]:
    heads, groups = hf["num_attention_heads"], hf["num_key_value_heads"]
    merge, split = qkv_merge(heads, groups, head_dim(hf))
    return [
        Entry(f"{mc_attn}.linear_qkv.weight",
              tuple(f"{hf_attn}.{p}_proj.weight" for p in "qkv"), i, merge, split),
        Entry(f"{mc_attn}.linear_proj.weight", (f"{hf_attn}.o_proj.weight",), i),
        Entry(f"{mc_attn}.q_layernorm.weight", (f"{hf_attn}.q_norm.weight",), i),
        Entry(f"{mc_attn}.k_layernorm.weight", (f"{hf_attn}.k_norm.weight",), i),
    ]


def swiglu_entries(hf_mlp: str, mc_mlp: str, i: int) -> list[Entry]:
    return [
        Entry(f"{mc_mlp}.linear_fc1.weight", (f"{hf_mlp}.gate_proj.weight", f"{hf_mlp}.up_proj.weight"),
              i, cat_rows, split_rows(2)),
        Entry(f"{mc_mlp}.linear_fc2.weight", (f"{hf_mlp}.down_proj.weight",), i),
    ]


def moe_layer(hf: dict[str, Any], i: int) -> bool:
    return moe_layers(hf)[i]


def mlp_entries(hf: dict[str, Any], i: int) -> list[Entry]:
    hf_mlp, mc_mlp = f"model.layers.{i}.mlp", f"decoder.layers.{i}.mlp"
    if not moe_layer(hf, i):
        return swiglu_entries(hf_mlp, mc_mlp, i)
    out = [Entry(f"{mc_mlp}.router.weight", (f"{hf_mlp}.gate.weight",), i)]
    for e in range(num_experts(hf)):
        out += swiglu_entries(f"{hf_mlp}.experts.{e}", f"{mc_mlp}.experts.local_experts.{e}", i)
    return out


def global_entries(hf: dict[str, Any], last: bool) -> list[Entry]:
    if not last:
        return [Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    out = [Entry("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if not hf["tie_word_embeddings"]:
        out.append(Entry("output_layer.weight", ("lm_head.weight",)))
    return out


def qwen3_weight_map(hf: dict[str, Any]) -> WeightAdapter:
    """Qwen3ForCausalLM and Qwen3MoeForCausalLM (which layers are MoE: `moe_layers`)."""
    entries = global_entries(hf, last=False)
    for i in range(hf["num_hidden_layers"]):
        hf_l, mc_l = f"model.layers.{i}", f"decoder.layers.{i}"
        entries += [Entry(f"{mc_l}.input_layernorm.weight", (f"{hf_l}.input_layernorm.weight",), i)]
        entries += attention_entries(hf, i, f"{hf_l}.self_attn", f"{mc_l}.self_attention")
        entries += [Entry(f"{mc_l}.pre_mlp_layernorm.weight", (f"{hf_l}.post_attention_layernorm.weight",), i)]
        entries += mlp_entries(hf, i)
    entries += global_entries(hf, last=True)
    return WeightAdapter(hf, entries)
