"""LoRA adapters on megatron-core attention layers and routed experts, with the base frozen.

API (stable; `qlora` builds on it):
- `apply_lora(model, cfg, seed) -> LoraReport`: before DDP wraps the model, freeze every base
  parameter and attach adapters to the targeted linears of each attention layer. Call it on the
  bare GPTModel (or a list of model chunks).
- `adapters_disabled(model)`: context in which the model is the base alone (the reference policy
  of KL, without a second copy of the weights).
- `merged_deltas(model)`: context in which each adapted base weight holds W + (α/r)·B·A (this rank's
  shard); yields the global names of the touched base tensors; the base is restored bit for bit
  on exit. Weight sync and HF export read the merged weights inside it.
- `lora_modules(model)`, `has_lora(model)`, `is_lora_param(p)`, `lora_state_dict(model)`.

Parallel split (the adapter follows its base layer): on a ColumnParallelLinear (linear_qkv) A is
replicated and B split on the output, as the weight; on a RowParallelLinear (linear_proj, "o") A is
split on the input and B replicated. The rank-r activation A·x is what crosses ranks: gathered over
the sequence (SP) before B on a column layer, reduced (or reduce-scattered under SP) after A on a
row layer, so each collective moves r columns, not the hidden size. Replicated adapter weights
that see only a sequence chunk under SP carry `sequence_parallel`, so `finalize_model_grads`
sums their gradients over TP as it does for norms.

q, k and v are separate adapters, as PEFT's on q_proj/k_proj/v_proj (each its own A, rank r), on
the fused linear_qkv laid out per query group as [q; k; v] (Qwen3-Next: [q; gate; k; v], where q and
gate together are HF's q_proj). Target `experts` puts PEFT's gate_proj/up_proj/down_proj adapters
on every routed expert of the local spec's SequentialMLP (expert-TP 1: tokens arrive dispatched,
so no collective is needed; the adapters carry megatron's expert mark `allreduce=False`). Initial
A is the same at every layout (a seeded full tensor, then this rank's slice); B starts at zero, so
the adapted model starts as the base.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config.schema import LoraConfig
from . import cpu_compat
from .quantize import dequantized_weights
from .sections import LORA_PARAM_ATTR

cpu_compat.require_applied()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.tensor_parallel import mappings  # noqa: E402
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint  # noqa: E402

ATTENTION_TARGETS = ("q", "k", "v", "o")
SUPPORTED_TARGETS = (*ATTENTION_TARGETS, "experts")
"""Targets with a code path; `gdn` is refused by the recipe lint."""
_ADAPTER_NAMES = {"linear_qkv": "lora_qkv", "linear_proj": "lora_proj", "linear_fc1": "lora_fc1",
                  "linear_fc2": "lora_fc2"}


@dataclass
class LoraReport:
    adapted: list[str] = field(default_factory=list)
    """Global names of the base weights that carry an adapter (this rank)."""
    trainable: int = 0
    """Adapter parameters on this rank."""
    frozen: int = 0
    """Base parameters on this rank (no gradient, no optimizer state)."""


def _unwrap(model: nn.Module) -> Any:
    inner: Any = model
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def _init_a(rows: int, cols: int, seed: int, tag: str) -> torch.Tensor:
    """PEFT's default A (Kaiming-uniform with a=√5, i.e. U(±1/√cols)), from a generator seeded by
    the adapter's global identity: the same full tensor at every layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + sum(ord(c) * 131 ** i for i, c in enumerate(tag)) % 2**31)
    bound = 1.0 / math.sqrt(cols)
    return (torch.rand(rows, cols, generator=g, dtype=torch.float64) * 2 - 1) * bound


def _tag(param: torch.Tensor, **attrs: Any) -> nn.Parameter:
    p = nn.Parameter(param)
    setattr(p, LORA_PARAM_ATTR, True)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class _Adapter(nn.Module):
    """Shared state: on/off switch, scale, the hooked base linear (not a child: its weight stays
    where the weight map expects it)."""

    a: nn.Parameter
    b: nn.Parameter

    def __init__(self, base: Any, weight_name: str, scale: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.scale = scale
        self.dropout = dropout
        """PEFT's lora_dropout on the adapter's input (training forward only: `self.training`)."""
        self.expert = bool(getattr(base, "is_expert", False))
        """An expert's linear: tokens arrive dispatched (no SP), its group is the expert-TP group,
        its gradients are reduced over the expert-data-parallel group."""
        self.enabled = True
        self.weight_name = weight_name
        """Global name of the base weight (weight-map name)."""
        self.name = weight_name.rsplit(".", 2)[0] + "." + _ADAPTER_NAMES[weight_name.rsplit(".", 2)[1]]
        """Global name of this adapter (its parameters: `<name>.a`, `<name>.b`)."""
        self._base = [base]          # a list: not registered as a submodule
        base.register_forward_hook(self._hook, with_kwargs=True)

    @property
    def base(self) -> Any:
        return self._base[0]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + self.delta_output(_fused_norm_input(module, x)).to(out.dtype), bias

    @property
    def group(self) -> Any:
        return ps.get_expert_tensor_parallel_group() if self.expert else ps.get_tensor_model_parallel_group()

    @property
    def sequence_parallel(self) -> bool:
        return not self.expert and bool(getattr(self.base, "sequence_parallel", False))

    def _param(self, t: torch.Tensor, **attrs: Any) -> nn.Parameter:
        w = self.base.weight
        if self.expert:
            attrs["allreduce"] = False      # megatron's mark of an expert parameter (expert-DP buffer)
        return _tag(t.to(w.dtype).to(w.device).contiguous(), **attrs)

    def _sharded(self, prefix: str, axis: dict[str, int], sharded_offsets: tuple) -> Any:
        groups = dict(tp_group=ps.get_expert_tensor_parallel_group(),
                      dp_cp_group=ps.get_expert_data_parallel_group()) if self.expert else {}
        return make_sharded_tensors_for_checkpoint(self.state_dict(keep_vars=True), prefix, axis, sharded_offsets,
                                                   **groups)

    def delta_output(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dropped(self, x: torch.Tensor) -> torch.Tensor:
        """dropout(x) for the adapter's input path, with masks drawn as Megatron draws its own: an
        input that differs between tensor-parallel ranks (split on the hidden dimension, a sequence
        chunk under SP, dispatched expert tokens) from the per-rank tracker streams, a replicated
        one from the default stream, which every TP rank advances alike, so all apply one mask."""
        if not self.training or self.dropout == 0.0:
            return x
        if self.expert:
            tracker = tensor_parallel.get_cuda_rng_tracker()
            rng: Any = tracker.fork(tensor_parallel.get_expert_parallel_rng_tracker_name())
        elif self.input_split:
            rng = tensor_parallel.get_cuda_rng_tracker().fork()
        else:
            rng = nullcontext()
        with rng:
            return torch.nn.functional.dropout(x, self.dropout, training=True)

    @property
    def input_split(self) -> bool:
        """Whether this rank's input differs from the other TP ranks' (see `dropped`)."""
        return self.sequence_parallel

    def delta_weight(self) -> torch.Tensor:
        """(α/r)·B·A in the shape and sharding of this rank's base weight."""
        raise NotImplementedError


def _fused_norm_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Transformer Engine fuses the input norm into linear_qkv (`TELayerNormColumnParallelLinear`):
    the hook sees the un-normed input, so apply the same RMSNorm (zero-centred where TE is)."""
    w = getattr(module, "layer_norm_weight", None)
    if w is None:
        return x
    eps = float(getattr(module, "eps", 1e-6))
    scale = w + 1 if getattr(module, "zero_centered_gamma", False) else w
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * scale


class ColumnAdapter(_Adapter):
    """LoRA on a column-parallel fused linear whose local output is `groups` blocks of `sections`
    rows each (linear_qkv: [q; k; v] per local query group). One (A_s, B_s) per targeted section."""

    def __init__(self, base: Any, weight_name: str, cfg: LoraConfig, groups: int,
                 sections: list[tuple[str, int]], targeted: list[str], seed: int) -> None:
        super().__init__(base, weight_name, cfg.alpha / cfg.rank, cfg.dropout)
        w = base.weight
        self.groups, self.sections, self.targeted, self.r = groups, sections, targeted, cfg.rank
        rows = {name: n for name, n in sections}
        a = torch.cat([_init_a(cfg.rank, w.shape[1], seed, f"{weight_name}/{s}") for s in targeted])
        self.a = self._param(a, sequence_parallel=self.sequence_parallel, tensor_model_parallel=False)
        # B per section, [groups, rows, r]: TP splits whole groups (dim 0: query groups of linear_qkv,
        # the one group of an expert's [gate; up]), as the weight.
        self.b = self._param(torch.zeros(groups, sum(rows[s] for s in targeted), cfg.rank),
                             tensor_model_parallel=True, partition_dim=0, partition_stride=1)

    def _targeted_rows(self) -> list[int]:
        rows = dict(self.sections)
        return [rows[s] for s in self.targeted]

    def _assemble(self, parts: dict[str, torch.Tensor], like: torch.Tensor, lead: tuple[int, ...],
                  tail: tuple[int, ...]) -> torch.Tensor:
        """Per-section blocks [*lead, groups, rows_s, *tail] (zeros where untargeted) → [*lead, out, *tail]."""
        blocks = [parts[s] if s in parts else like.new_zeros(*lead, self.groups, n, *tail) for s, n in self.sections]
        cat = torch.cat(blocks, dim=len(lead) + 1)
        return cat.reshape(*lead, -1, *tail)

    def delta_output(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0:
            # PEFT's q_proj/k_proj/v_proj (gate_proj/up_proj) are separate modules, each with its
            # own dropout: one mask per section.
            h = torch.cat([torch.nn.functional.linear(self.dropped(x), a_s)
                           for a_s in torch.split(self.a, self.r, dim=0)], dim=-1)
        else:
            h = torch.nn.functional.linear(x, self.a)                   # [s(/tp), b, n·r]
        if self.sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(h)       # bwd: reduce-scatter
        else:
            h = mappings.copy_to_tensor_model_parallel_region(h, self.group)   # bwd: all-reduce over TP
        lead = tuple(h.shape[:-1])
        parts = {}
        for i, (s, b_s) in enumerate(zip(self.targeted, torch.split(self.b, self._targeted_rows(), dim=1))):
            h_s = h[..., i * self.r:(i + 1) * self.r]
            parts[s] = torch.einsum("...r,gnr->...gn", h_s, b_s)
        return self._assemble(parts, h, lead, ()) * self.scale

    def delta_weight(self) -> torch.Tensor:
        parts = {}
        for i, (s, b_s) in enumerate(zip(self.targeted, torch.split(self.b, self._targeted_rows(), dim=1))):
            parts[s] = torch.einsum("gnr,ri->gni", b_s, self.a[i * self.r:(i + 1) * self.r])
        return self._assemble(parts, self.a, (), (self.a.shape[1],)) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        return self._sharded(prefix, {"b": 0}, sharded_offsets)


class RowAdapter(_Adapter):
    """LoRA on a row-parallel linear (linear_proj, "o"): A split on the input like the weight, B
    replicated; the rank-r product is reduced over TP (reduce-scattered over the sequence under SP)."""

    def __init__(self, base: Any, weight_name: str, cfg: LoraConfig, seed: int) -> None:
        super().__init__(base, weight_name, cfg.alpha / cfg.rank, cfg.dropout)
        w = base.weight
        tp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        full = _init_a(cfg.rank, w.shape[1] * tp, seed, f"{weight_name}/o")
        local = full[:, rank * w.shape[1]:(rank + 1) * w.shape[1]]
        self.a = self._param(local, tensor_model_parallel=True, partition_dim=1, partition_stride=1)
        self.b = self._param(torch.zeros(w.shape[0], cfg.rank), sequence_parallel=self.sequence_parallel,
                             tensor_model_parallel=False)

    @property
    def input_split(self) -> bool:
        return dist.get_world_size(self.group) > 1      # each TP rank holds other heads' outputs

    def delta_output(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(self.dropped(x), self.a)        # partial over TP
        if self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h, self.group)
        return torch.nn.functional.linear(h, self.b) * self.scale

    def delta_weight(self) -> torch.Tensor:
        return (self.b @ self.a) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        return self._sharded(prefix, {"a": 1}, sharded_offsets)


def _qkv_sections(attn: Any) -> tuple[int, list[tuple[str, int]]]:
    """(local query groups, [(section, rows per group)]) of linear_qkv: k and v are one head each,
    q the rest (with Qwen3-Next's output gate, q's heads then the gate's, both HF's q_proj)."""
    cfg = attn.config
    groups = cfg.num_query_groups // ps.get_tensor_model_parallel_world_size()
    per_group = attn.linear_qkv.weight.shape[0] // groups
    return groups, [("q", per_group - 2 * cfg.kv_channels), ("k", cfg.kv_channels), ("v", cfg.kv_channels)]


def _attention_layers(gpt: Any) -> Iterator[tuple[int, Any]]:
    for layer in gpt.decoder.layers:
        attn = getattr(layer, "self_attention", None)
        if attn is not None and hasattr(attn, "linear_qkv") and hasattr(attn, "linear_proj"):
            yield layer.layer_number - 1, attn


def _expert_mlps(gpt: Any) -> Iterator[tuple[str, Any]]:
    """(global weight-name prefix, expert MLP) of this rank's routed experts (local spec's
    SequentialMLP; TE's grouped GEMM has no per-expert linears to hook)."""
    for layer in gpt.decoder.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None:
            continue
        if not hasattr(experts, "local_experts"):
            raise ValueError(f"lora.targets 'experts': {type(experts).__name__} (grouped GEMM) has no per-expert "
                             "linears; LoRA on experts needs the SequentialMLP experts (moe_grouped_gemm off)")
        if dist.get_world_size(ps.get_expert_tensor_parallel_group()) > 1:
            raise ValueError("lora.targets 'experts' needs parallelism.expert_tensor_parallel_size 1")
        first = ps.get_expert_model_parallel_rank() * len(experts.local_experts)
        for i, mlp in enumerate(experts.local_experts):
            yield f"decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts.{first + i}", mlp


def _adapt_experts(gpt: Any, cfg: LoraConfig, seed: int, report: LoraReport) -> None:
    """PEFT's gate_proj/up_proj/down_proj adapters on every routed expert."""
    for prefix, mlp in _expert_mlps(gpt):
        ffn = mlp.linear_fc1.weight.shape[0] // 2
        mlp.lora_fc1 = ColumnAdapter(mlp.linear_fc1, f"{prefix}.linear_fc1.weight", cfg, 1,
                                     [("gate", ffn), ("up", ffn)], ["gate", "up"], seed)
        mlp.lora_fc2 = RowAdapter(mlp.linear_fc2, f"{prefix}.linear_fc2.weight", cfg, seed)
        report.adapted += [mlp.lora_fc1.weight_name, mlp.lora_fc2.weight_name]


def apply_lora(model: nn.Module | list[nn.Module], cfg: LoraConfig, seed: int = 0) -> LoraReport:
    """Freeze the base and attach adapters (before DDP: it only buffers trainable parameters)."""
    unsupported = sorted(set(cfg.targets) - set(SUPPORTED_TARGETS))
    if unsupported:
        raise ValueError(f"lora.targets {unsupported}: no adapter code path yet (supported: {list(SUPPORTED_TARGETS)})")
    if cfg.rank <= 0:
        raise ValueError("apply_lora needs lora.rank > 0")
    report = LoraReport()
    for chunk in model if isinstance(model, list) else [model]:
        gpt = _unwrap(chunk)
        for p in gpt.parameters():
            p.requires_grad_(False)
            report.frozen += p.numel()
        for layer, attn in _attention_layers(gpt):
            prefix = f"decoder.layers.{layer}.self_attention"
            qkv: list[str] = [t for t in ("q", "k", "v") if t in cfg.targets]
            if qkv:
                groups, sections = _qkv_sections(attn)
                attn.lora_qkv = ColumnAdapter(attn.linear_qkv, f"{prefix}.linear_qkv.weight", cfg, groups,
                                              sections, qkv, seed)
                report.adapted.append(attn.lora_qkv.weight_name)
            if "o" in cfg.targets:
                attn.lora_proj = RowAdapter(attn.linear_proj, f"{prefix}.linear_proj.weight", cfg, seed)
                report.adapted.append(attn.lora_proj.weight_name)
        if "experts" in cfg.targets:
            _adapt_experts(gpt, cfg, seed, report)
        report.trainable += sum(p.numel() for p in gpt.parameters() if p.requires_grad)
    return report


def lora_modules(model: nn.Module | list[nn.Module]) -> list[_Adapter]:
    chunks = model if isinstance(model, list) else [model]
    return [m for c in chunks for m in _unwrap(c).modules() if isinstance(m, _Adapter)]


def has_lora(model: nn.Module | list[nn.Module]) -> bool:
    return bool(lora_modules(model))


def is_lora_param(p: torch.Tensor) -> bool:
    return bool(getattr(p, LORA_PARAM_ATTR, False))


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's adapter tensors by local parameter name (detached)."""
    return {n: p.detach() for n, p in _unwrap(model).named_parameters() if is_lora_param(p)}


@dataclass
class AdapterShard:
    name: str
    """Global name, e.g. `decoder.layers.3.self_attention.lora_qkv.b`."""
    param: nn.Parameter
    tp_dim: int | None
    """Dimension split over TP (None: replicated)."""


def adapter_shards(model: nn.Module | list[nn.Module]) -> list[AdapterShard]:
    """This rank's adapter parameters with their global names and TP split."""
    out = []
    for m in lora_modules(model):
        for key, p in (("a", m.a), ("b", m.b)):
            split = getattr(p, "tensor_model_parallel", False)
            out.append(AdapterShard(f"{m.name}.{key}", p, getattr(p, "partition_dim", None) if split else None))
    return out


LORA_KEY = ".lora_"
"""In every adapter's parameter and checkpoint key (`…self_attention.lora_qkv.a`), in no base key."""


def lora_part(sharded: dict[str, Any], adapters: bool) -> dict[str, Any]:
    """The adapter (or the base) entries of a model's flat (sharded) state dict."""
    return {k: v for k, v in sharded.items() if (LORA_KEY in k) == adapters}


def load_part(actor: Any, state: dict[str, Any], adapters: bool) -> None:
    """`load_state_dict` of one part (all of it when the actor has no LoRA): every key of that
    part must arrive; the other part stays as it is."""
    model = _unwrap(actor.model)
    if getattr(actor, "lora", None) is None:
        model.load_state_dict(state)
        return
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if (LORA_KEY in k) == adapters and not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"LoRA {'adapter' if adapters else 'base'} load: missing {missing[:5]}, "
                           f"unexpected {result.unexpected_keys[:5]}")


@contextmanager
def adapters_disabled(model: nn.Module | list[nn.Module]) -> Iterator[None]:
    mods = lora_modules(model)
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m, was in zip(mods, before):
            m.enabled = was


@contextmanager
def merged_deltas(model: nn.Module | list[nn.Module]) -> Iterator[set[str]]:
    """Each adapted base weight holds W + ΔW (adapters off meanwhile, so a forward inside is the
    merged model, not W + 2ΔW); yields the touched global names; restores W exactly. A quantized
    (QLoRA) base weight is merged into a dense copy, and the quantized one is put back after.
    Tensors read inside may alias the parameters (an unsharded weight is the parameter itself):
    copy or write them before the context exits."""
    mods = lora_modules(model)
    with dequantized_weights([m.base for m in mods]):
        saved = [m.base.weight.detach().clone() for m in mods]
        with torch.no_grad():
            for m in mods:
                m.base.weight.add_(m.delta_weight().to(m.base.weight.dtype))
        try:
            with adapters_disabled(model):
                yield {m.weight_name for m in mods}
        finally:
            with torch.no_grad():
                for m, w in zip(mods, saved):
                    m.base.weight.copy_(w)
