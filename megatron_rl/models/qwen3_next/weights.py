"""Weight map of Qwen3NextForCausalLM, local (non-TE) spec names.

HF names are those transformers 5.19 writes with `save_pretrained` (experts per expert on disk,
although fused in memory). Layouts that differ between the two sides:
- gated attention: HF's q_proj rows are [q_h; gate_h] per head; Megatron's linear_qkv is grouped
  per query group as [q heads; gate heads; k; v].
- Gated DeltaNet: HF groups in_proj_qkvz as [q; k; v; z] and in_proj_ba as [b; a] per *key* head;
  Megatron's in_proj is sectioned [q; k; v; z; beta; alpha], each section in head order.
- GDN output norm: HF's Qwen3NextRMSNormGated is plain-scale (y = x̂·w, w init 1); Megatron builds
  it zero-centred like every other Qwen3-Next norm (y = x̂·(1+p)), as Megatron's own TE spec and
  Megatron-Bridge do, so p = w − 1 is stored, under the same dist-checkpoint key as Megatron-Bridge
  (`RMSNorm2ZeroCenteredRMSNormMapping`): our torch_dist checkpoints and theirs interchange. The
  ±1 is exact (a bit-identical round trip) for every w ≥ 0.5 in the tensor's own dtype (w − 1 then
  needs no more significant bits than w); a weight below 0.5 may lose its lowest bits (logged, with
  the tensor's name and the count).
Everything else maps one to one: the other zero-centred norms store the same w on both sides
(y = x̂·(1+w) in HF and Megatron).

`mtp.*` (the multi-token-prediction layer of released checkpoints) is dropped on import and listed:
the Megatron model has no MTP layer (like transformers and vLLM's main model, which ignore it), so
those weights would neither be trained nor stay consistent with the trained trunk; exporting the
base model's MTP head next to a fine-tuned trunk would hand a speculative decoder a stale draft
model. Use the original release's `mtp.*` deliberately if you want that.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...model_config import head_dim
from ...weights.map import (
    Entry,
    Merge,
    Split,
    Tensor,
    WeightAdapter,
    interleave_groups,
    split_groups,
)
from ..qwen3.weights import attention_entries, global_entries, mlp_entries, moe_layer, swiglu_entries
from .layers import LINEAR, layer_types

log = logging.getLogger(__name__)
MTP_PREFIX = "mtp."


def gated_qkv_merge(hf: dict[str, Any]) -> tuple[Merge, Split]:
    """(q_proj with interleaved gate, k_proj, v_proj) ↔ Megatron's gated linear_qkv."""
    heads, groups, dim = hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf)
    per_group = heads // groups

    def merge(ts: list[Tensor]) -> Tensor:
        q, gate = split_groups(ts[0], heads, [dim, dim])
        return interleave_groups([q, gate, ts[1], ts[2]], groups)

    def split(t: Tensor) -> list[Tensor]:
        q, gate, k, v = split_groups(t, groups, [per_group * dim, per_group * dim, dim, dim])
        return [interleave_groups([q, gate], heads), k, v]

    return merge, split


def gdn_in_proj_merge(hf: dict[str, Any]) -> tuple[Merge, Split]:
    """(in_proj_qkvz, in_proj_ba) grouped per key head ↔ Megatron's sectioned in_proj."""
    k_heads, v_heads = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dk, dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    ratio = v_heads // k_heads   # value heads per key head

    def merge(ts: list[Tensor]) -> Tensor:
        q, k, v, z = split_groups(ts[0], k_heads, [dk, dk, ratio * dv, ratio * dv])
        b, a = split_groups(ts[1], k_heads, [ratio, ratio])
        return torch.cat([q, k, v, z, b, a], dim=0)

    def split(t: Tensor) -> list[Tensor]:
        q, k, v, z, b, a = torch.split(t, [k_heads * dk] * 2 + [v_heads * dv] * 2 + [v_heads] * 2, dim=0)
        return [interleave_groups([q, k, v, z], k_heads), interleave_groups([b, a], k_heads)]

    return merge, split


def to_zero_centred(name: str) -> Merge:
    """HF plain-scale norm weight w → Megatron zero-centred p = w − 1 (in fp32, back to w's dtype)."""

    def merge(ts: list[Tensor]) -> Tensor:
        w = ts[0]
        p = (w.float() - 1.0).to(w.dtype)
        lost = 0 if w.is_meta else int((from_zero_centred(p)[0] != w).sum())
        if lost:
            log.warning("%s: %d of %d weights below 0.5 lose low bits in w - 1 (export will differ there)",
                        name, lost, w.numel())
        return p

    return merge


def from_zero_centred(t: Tensor) -> list[Tensor]:
    return [(t.float() + 1.0).to(t.dtype)]


def gdn_entries(hf: dict[str, Any], i: int) -> list[Entry]:
    hf_a, mc_a = f"model.layers.{i}.linear_attn", f"decoder.layers.{i}.self_attention"
    merge, split = gdn_in_proj_merge(hf)
    out = [Entry(f"{mc_a}.in_proj.weight", (f"{hf_a}.in_proj_qkvz.weight", f"{hf_a}.in_proj_ba.weight"),
                 i, merge, split),
           Entry(f"{mc_a}.out_norm.weight", (f"{hf_a}.norm.weight",), i, to_zero_centred(f"{hf_a}.norm.weight"),
                 from_zero_centred)]
    same = {"conv1d.weight": "conv1d.weight", "A_log": "A_log", "dt_bias": "dt_bias",
            "out_proj.weight": "out_proj.weight"}
    out += [Entry(f"{mc_a}.{mc}", (f"{hf_a}.{name}",), i) for mc, name in same.items()]
    return out


def gated_attention_entries(hf: dict[str, Any], i: int) -> list[Entry]:
    """Qwen3's attention entries, with the fused q/gate/k/v projection in place of q/k/v."""
    hf_a, mc_a = f"model.layers.{i}.self_attn", f"decoder.layers.{i}.self_attention"
    plain = attention_entries(hf, i, hf_a, mc_a)
    merge, split = gated_qkv_merge(hf)
    qkv = Entry(plain[0].mcore, plain[0].hf, i, merge, split)
    return [qkv] + [e for e in plain if e.mcore != qkv.mcore]


def shared_expert_entries(hf: dict[str, Any], i: int) -> list[Entry]:
    if not (moe_layer(hf, i) and hf["shared_expert_intermediate_size"]):
        return []
    hf_mlp, mc_mlp = f"model.layers.{i}.mlp", f"decoder.layers.{i}.mlp"
    return swiglu_entries(f"{hf_mlp}.shared_expert", f"{mc_mlp}.shared_experts", i) + [
        Entry(f"{mc_mlp}.shared_experts.gate_weight", (f"{hf_mlp}.shared_expert_gate.weight",), i)]


def qwen3_next_weight_map(hf: dict[str, Any]) -> WeightAdapter:
    entries = global_entries(hf, last=False)
    for i, kind in enumerate(layer_types(hf)):
        hf_l, mc_l = f"model.layers.{i}", f"decoder.layers.{i}"
        entries.append(Entry(f"{mc_l}.input_layernorm.weight", (f"{hf_l}.input_layernorm.weight",), i))
        entries += gdn_entries(hf, i) if kind == LINEAR else gated_attention_entries(hf, i)
        entries.append(Entry(f"{mc_l}.pre_mlp_layernorm.weight", (f"{hf_l}.post_attention_layernorm.weight",), i))
        entries += mlp_entries(hf, i) + shared_expert_entries(hf, i)
    entries += global_entries(hf, last=True)
    return WeightAdapter(hf, entries, ignored_hf_prefixes=(MTP_PREFIX,))
