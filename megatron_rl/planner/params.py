"""Exact parameter counts of Qwen3-family models from an HF `config.json`, and how they shard.

Supported architectures (the model registry, `megatron_rl.models`, says what each one has):
Qwen3ForCausalLM (dense), Qwen3MoeForCausalLM and Qwen3NextForCausalLM. Counts follow the tensor
shapes of the transformers implementations (checked against real `sum(p.numel())` in tests/unit/test_planner.py):

* full attention: q/k/v/o projections (Qwen3-Next's q_proj is twice as wide: query + output gate),
  q_norm and k_norm over head_dim;
* Gated DeltaNet (Qwen3-Next `linear_attention` layers): in_proj_qkvz, in_proj_ba, a depthwise
  conv1d over q/k/v, dt_bias, A_log, a gated RMSNorm over the value head dim, out_proj;
* feed-forward: a SwiGLU MLP, or a MoE block (router + routed experts, plus on Qwen3-Next a shared
  expert and its sigmoid gate), chosen per layer by `mlp_only_layers` / `decoder_sparse_step`;
* two RMSNorms per layer, the final norm, the embedding and (unless tied) the output layer.

Multi-token prediction: counted only when the config declares it (`num_nextn_predict_layers` or
`mtp_num_hidden_layers` > 0), as component "mtp". The public Qwen3-Next config declares none (its
checkpoint ships `mtp.*` tensors that transformers ignores and the RL trainer does not train), so
the production counts exclude MTP.

Sharding (Megatron-core): every block carries a `Shard`. TP: column/row-parallel projections,
vocab-parallel embedding/output, the GDN projections, conv1d, dt_bias and A_log (split by heads),
dense and shared-expert MLPs. EXPERT: routed experts, split into whole experts over EP and inside
each expert over ETP. REPLICATED: norms (incl. q/k norms and the GDN gated norm), the router and
the shared-expert gate, which every TP and EP rank holds in full.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .. import models
from ..model_config import moe_layers, num_experts, with_hf_defaults
from ..models.model_spec import PlannerShape

COMPONENTS: tuple[str, ...] = ("embedding", "output", "attention", "linear_attention", "dense_mlp",
                               "moe_experts", "shared_experts", "router", "norms", "mtp")


class PlannerError(ValueError):
    """The model or layout cannot be planned (unsupported architecture, missing config field)."""


class Shard(str, Enum):
    TP = "tp"
    EXPERT = "expert"
    REPLICATED = "replicated"


@dataclass(frozen=True)
class Block:
    """Tensors of one component that shard the same way."""

    component: str
    shard: Shard
    params: int
    active: int
    """Parameters used for one token (differs from `params` only for routed experts)."""

    def per_gpu(self, tp: int, ep: int, etp: int) -> float:
        divisor = {Shard.TP: tp, Shard.EXPERT: ep * etp, Shard.REPLICATED: 1}[self.shard]
        return self.params / divisor


def _block(component: str, shard: Shard, params: int, active: int | None = None) -> Block:
    return Block(component, shard, params, params if active is None else active)


@dataclass(frozen=True)
class Layer:
    mixer: str
    """'full_attention' or 'linear_attention' (Gated DeltaNet)."""
    ffn: str
    """'moe' or 'dense'."""
    blocks: tuple[Block, ...]

    @property
    def params(self) -> int:
        return sum(b.params for b in self.blocks)


@dataclass(frozen=True)
class Dims:
    """The config fields the counts and the activation model read, with transformers' defaults."""

    hidden: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    attention_bias: bool
    tied: bool
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    layer_types: tuple[str, ...] = ()
    lin_key_heads: int = 0
    lin_value_heads: int = 0
    lin_key_dim: int = 0
    lin_value_dim: int = 0
    conv_kernel: int = 0
    mtp_layers: int = 0

    @property
    def lin_conv_dim(self) -> int:
        return 2 * self.lin_key_heads * self.lin_key_dim + self.lin_value_heads * self.lin_value_dim


def _int(hf: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if value is None:
        raise PlannerError(f"model config has no {key!r}")
    return int(value)


def _layer_types(hf: Mapping[str, Any]) -> tuple[str, ...]:
    try:
        return tuple(models.layer_types(dict(hf)))     # the architecture's own layer pattern
    except ValueError as exc:
        raise PlannerError(str(exc)) from None


def read_dims(hf: Mapping[str, Any], spec: PlannerShape) -> Dims:
    hf = with_hf_defaults(dict(hf))        # absent keys as transformers reads them
    hidden, heads = _int(hf, "hidden_size"), _int(hf, "num_attention_heads")
    layers = _int(hf, "num_hidden_layers")
    # transformers 5 writes `num_local_experts` (and `num_experts: None`); one reader for both.
    experts = num_experts(dict(hf)) if spec.moe else 0
    moe = experts > 0
    return Dims(
        hidden=hidden, vocab=_int(hf, "vocab_size"), layers=layers, heads=heads,
        kv_heads=_int(hf, "num_key_value_heads", heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        intermediate=_int(hf, "intermediate_size"),
        attention_bias=bool(hf.get("attention_bias", False)),
        tied=bool(hf.get("tie_word_embeddings", False)),
        experts=experts,
        top_k=_int(hf, "num_experts_per_tok") if moe else 0,
        moe_intermediate=_int(hf, "moe_intermediate_size") if moe else 0,
        shared_intermediate=_int(hf, "shared_expert_intermediate_size", 0) if spec.shared_expert else 0,
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        decoder_sparse_step=_int(hf, "decoder_sparse_step", 1),
        layer_types=_layer_types(hf),
        lin_key_heads=_int(hf, "linear_num_key_heads", 0) if spec.hybrid else 0,
        lin_value_heads=_int(hf, "linear_num_value_heads", 0) if spec.hybrid else 0,
        lin_key_dim=_int(hf, "linear_key_head_dim", 0) if spec.hybrid else 0,
        lin_value_dim=_int(hf, "linear_value_head_dim", 0) if spec.hybrid else 0,
        conv_kernel=_int(hf, "linear_conv_kernel_dim", 0) if spec.hybrid else 0,
        mtp_layers=int(hf.get("num_nextn_predict_layers") or hf.get("mtp_num_hidden_layers") or 0),
    )


def attention_blocks(d: Dims, spec: PlannerShape) -> list[Block]:
    q_out = d.heads * d.head_dim * (2 if spec.gated_attention else 1)
    kv_out = d.kv_heads * d.head_dim
    weights = d.hidden * (q_out + 2 * kv_out) + d.heads * d.head_dim * d.hidden
    biases = (q_out + 2 * kv_out + d.hidden) if d.attention_bias else 0
    return [_block("attention", Shard.TP, weights + biases),
            _block("attention", Shard.REPLICATED, 2 * d.head_dim)]  # q_norm, k_norm


def linear_attention_blocks(d: Dims) -> list[Block]:
    key_dim, value_dim = d.lin_key_heads * d.lin_key_dim, d.lin_value_heads * d.lin_value_dim
    split = (d.hidden * (2 * key_dim + 2 * value_dim)  # in_proj_qkvz
             + d.hidden * 2 * d.lin_value_heads        # in_proj_ba
             + d.lin_conv_dim * d.conv_kernel          # depthwise conv1d, no bias
             + 2 * d.lin_value_heads                   # dt_bias, A_log
             + value_dim * d.hidden)                   # out_proj
    return [_block("linear_attention", Shard.TP, split),
            _block("linear_attention", Shard.REPLICATED, d.lin_value_dim)]  # gated RMSNorm


def is_moe_layer(d: Dims, index: int) -> bool:
    pattern = moe_layers({"num_experts": d.experts, "num_hidden_layers": d.layers,
                          "decoder_sparse_step": d.decoder_sparse_step, "mlp_only_layers": list(d.mlp_only_layers)})
    return pattern[index]


def ffn_blocks(d: Dims, moe: bool) -> list[Block]:
    if not moe:
        return [_block("dense_mlp", Shard.TP, 3 * d.hidden * d.intermediate)]
    expert = 3 * d.hidden * d.moe_intermediate
    blocks = [_block("moe_experts", Shard.EXPERT, d.experts * expert, d.top_k * expert),
              _block("router", Shard.REPLICATED, d.experts * d.hidden)]
    if d.shared_intermediate:
        blocks += [_block("shared_experts", Shard.TP, 3 * d.hidden * d.shared_intermediate),
                   _block("shared_experts", Shard.REPLICATED, d.hidden)]  # sigmoid gate
    return blocks


def decoder_layer(d: Dims, spec: PlannerShape, index: int) -> Layer:
    mixer = d.layer_types[index]
    mixers: dict[str, Callable[[], list[Block]]] = {
        "full_attention": lambda: attention_blocks(d, spec),
        "linear_attention": lambda: linear_attention_blocks(d),
    }
    if mixer not in mixers:
        raise PlannerError(f"layer {index}: unsupported layer type {mixer!r}")
    moe = is_moe_layer(d, index)
    blocks = mixers[mixer]() + ffn_blocks(d, moe) + [_block("norms", Shard.REPLICATED, 2 * d.hidden)]
    return Layer(mixer, "moe" if moe else "dense", tuple(blocks))


def mtp_blocks(d: Dims, spec: PlannerShape) -> list[Block]:
    """One MTP depth (Qwen3-Next layout): fc over [embedding; hidden], three norms, and one
    full-attention decoder layer; it shares the embedding and output layer with the trunk."""
    per_depth = [_block("mtp", Shard.TP, 2 * d.hidden * d.hidden),
                 _block("mtp", Shard.REPLICATED, 3 * d.hidden)]
    per_depth += [Block("mtp", b.shard, b.params, b.active) for b in
                  attention_blocks(d, spec) + ffn_blocks(d, d.experts > 0)]
    per_depth.append(_block("mtp", Shard.REPLICATED, 2 * d.hidden))
    return per_depth * d.mtp_layers


@dataclass(frozen=True)
class ModelParams:
    architecture: str
    spec: PlannerShape
    dims: Dims
    pre: tuple[Block, ...]
    """On the first pipeline stage: the embedding."""
    layers: tuple[Layer, ...]
    post: tuple[Block, ...]
    """On the last pipeline stage: final norm, output layer, MTP."""

    def blocks(self) -> Iterator[Block]:
        yield from self.pre
        for layer in self.layers:
            yield from layer.blocks
        yield from self.post

    @property
    def total(self) -> int:
        return sum(b.params for b in self.blocks())

    @property
    def active(self) -> int:
        """Parameters used per token, embedding and output included (Qwen's model-card convention:
        Qwen3-30B-A3B's '3.3B activated' only comes out with both)."""
        return sum(b.active for b in self.blocks())

    @property
    def embedding_params(self) -> int:
        return self.component("embedding") + self.component("output")

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding_params

    def component(self, name: str) -> int:
        return sum(b.params for b in self.blocks() if b.component == name)

    def breakdown(self) -> dict[str, dict[str, int]]:
        """component → {'total', 'active', and params per Shard}."""
        out: dict[str, dict[str, int]] = {}
        for b in self.blocks():
            row = out.setdefault(b.component, {"total": 0, "active": 0})
            row["total"] += b.params
            row["active"] += b.active
            row[b.shard.value] = row.get(b.shard.value, 0) + b.params
        return {name: out[name] for name in COMPONENTS if name in out}


def count_params(hf: Mapping[str, Any]) -> ModelParams:
    """Exact parameter counts of the model an HF config dict describes."""
    try:
        arch, spec = models.architecture(dict(hf)), models.planner_shape(dict(hf))
    except models.UnknownArchitecture as exc:
        raise PlannerError(f"unsupported architecture {exc.named!r}; "
                           f"the planner knows: {', '.join(exc.supported)}") from None
    d = read_dims(hf, spec)
    embedding = _block("embedding", Shard.TP, d.vocab * d.hidden)
    post = [_block("norms", Shard.REPLICATED, d.hidden),
            _block("output", Shard.TP, 0 if d.tied else d.vocab * d.hidden)]
    layers = tuple(decoder_layer(d, spec, i) for i in range(d.layers))
    return ModelParams(arch, spec, d, (embedding,), layers, tuple(post + mtp_blocks(d, spec)))
