"""Per-GPU memory of a recipe's layout: trainer (Megatron-core), reference model, vLLM rollout.

Units: GB = 10^9 bytes. An "80 GB" card has ~85.5e9 bytes (81,559 MiB), so budgets in decimal GB
are a little conservative on purpose.

Trainer terms, for the worst pipeline stage (the first holds the most in-flight activations and the
embedding; the last holds the output layer and the logits — both are computed, the larger wins):

* weights: the stage's parameters as sharded by `params.Shard` (TP / EP×ETP / replicated), in the
  training dtype (bf16: 2 bytes);
* gradients: Megatron keeps fp32 main grads for bf16 training (accumulate/all-reduce in fp32):
  4 bytes per parameter;
* optimizer: Adam m and v plus fp32 master weights = 12 bytes per parameter (8 when the model
  itself is fp32). The distributed optimizer shards dense parameters over the data-parallel group
  with context parallelism folded in (DP×CP = world/(TP·PP): CP ranks hold identical weights) and
  expert parameters over the expert-data-parallel group world/(PP·EP·ETP). This is the
  "6 + 12/d bytes per parameter" of Megatron-core's distributed-optimizer documentation.
  `optimizer_cpu_offload` moves states and master weights to host memory (reported, not counted);
* activations: see `layer_activation_bytes`; per micro-batch, times the micro-batches in flight;
* logits (last stage): bf16 logits plus fp32 log-softmax over the vocab-parallel shard;
* reference model: bf16 weights sharded like the actor, whenever `model.reference` is not 'none';
* vLLM, when colocated: vLLM claims `gpu_memory_utilization` × the card for weights + KV cache;
* overhead: OVERHEAD_GB (CUDA context and cuBLAS workspaces ~1 GB, NCCL buffers of the
  TP/PP/DP/EP/CP communicators ~2 GB, caching-allocator fragmentation ~1 GB).

With `lora.rank` > 0 the weights are a frozen base (in NF4 with `base_quantization: nf4`) plus
adapters, and only the adapters have gradients and optimizer states; the reference is the base
with the adapters off (no term); see `lora.py`.

Activation model (bytes stored per token per layer, bf16): the accounting of Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198, §4),
which gives 34·s·b·h/t per layer with tensor + sequence parallelism plus 5·a·s²·b/t for the
attention scores, adapted to these models: no dropout in the model (p = 0 for RL fine-tuning, so no
masks; LoRA's `lora.dropout` adds its own copies and masks, `lora_dropout_bytes_per_token`);
flash attention (saves q, k, v, the output and a log-sum-exp instead of the s² scores — which also
makes Megatron's 'selective' recompute (core attention) save nothing further); GQA (k, v have g
heads); SwiGLU (fc1 gives 2f, the down projection's input f); and two further mixers/FFNs:

  per layer, elements per token = 4h/r                         (two RMSNorm inputs and outputs)
    + full attention:  [(a+g)d + (a+2g)d + ad (+2ad gated)]/t  (q/k-norm inputs; q, k, v; output;
                                                                 Qwen3-Next's sigmoid gate, gated out)
    + Gated DeltaNet:  [2kd+2vd+2nv + 2·conv + 4nv + 2vd]/t      (in_proj outputs; conv pre/post
                                                                 SiLU; fp32 g, beta; core and
                                                                 gated-norm outputs; chunk states
                                                                 are recomputed by the kernel)
    + dense MLP:       3f/t
    + MoE:             2E/r (fp32 router probs) + [3f_s/t + h/r] (shared expert, gate input) and, per
                       local token, k·ETP routed copies of (2h + 3f_e/ETP) (expert input and output,
                       fc1 output, down input), assuming balanced routing
  with r = t under sequence parallelism (else 1), t = TP, and s·b/CP tokens per rank.

Recompute 'full' keeps only each chunk's input (2·h/r bytes per token) and rematerializes one chunk
(`recompute_num_layers` layers with 'uniform'; one layer with 'block', whose non-recomputed layers
keep everything). Every mode adds one chunk/layer for the backward working set. In-flight
micro-batches under 1F1B: PP − stage (capped by the micro-batch count); interleaving multiplies the
first stage by 1 + (PP−1)/(PP·VPP) (Korthikanti et al. §4.2.3).

vLLM (rollout): weights at its TP (dense) and TP×DP (experts, with expert parallelism) in its dtype;
KV cache of the full-attention layers (KV heads replicated when TP > num_key_value_heads) plus the
fixed Gated DeltaNet conv/recurrent state per sequence; VLLM_RUNTIME_GB for its activations, CUDA
graphs and sampler. The KV budget is what is left of `gpu_memory_utilization` × the card.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config.schema import RecipeConfig
from .lora import StageParams, stage_params
from .params import Block, Dims, Layer, ModelParams, PlannerError, Shard

GB = 1e9
GRAD_BYTES = 4
ADAM_STATE_BYTES = 8
MASTER_WEIGHT_BYTES = 4
OVERHEAD_GB = 4.0
VLLM_RUNTIME_GB = 3.0
DTYPE_BYTES: dict[str, int] = {"auto": 2, "bf16": 2, "bfloat16": 2, "fp32": 4, "float32": 4}


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    gpu: str = "H100"
    """GPU type of the time model's constants (`gpus.GPUS`)."""
    host_memory_gb: float = 2048.0
    """RAM of one node (the host verdict's capacity)."""


@dataclass(frozen=True)
class Layout:
    """The trainer-side numbers of a recipe the memory model needs."""

    world: int
    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int
    sp: bool
    recompute: str
    recompute_method: str
    recompute_num_layers: int
    distributed_optimizer: bool
    optimizer_offload: bool
    optimizer_offload_fraction: float
    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    param_bytes: int
    reference: bool
    max_tokens_per_microbatch: int | None = None
    lora_rank: int = 0
    """LoRA rank; 0 trains the full model (see `lora.py` for what a frozen base costs)."""
    lora_targets: tuple[str, ...] = ()
    base_quantization: str = "none"
    lora_dropout: float = 0.0
    """With dropout the adapters' input is a new tensor per adapter, kept with its mask."""

    @classmethod
    def from_recipe(cls, cfg: RecipeConfig) -> Layout:
        p, t = cfg.parallelism, cfg.trainer
        return cls(world=p.nodes * p.gpus_per_node, tp=p.tensor_model_parallel_size,
                   pp=p.pipeline_model_parallel_size, vpp=p.virtual_pipeline_model_parallel_size,
                   cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                   etp=p.expert_tensor_parallel_size or p.tensor_model_parallel_size,
                   sp=p.sequence_parallel, recompute=p.recompute_granularity,
                   recompute_method=p.recompute_method, recompute_num_layers=p.recompute_num_layers,
                   distributed_optimizer=p.use_distributed_optimizer,
                   optimizer_offload=p.optimizer_cpu_offload,
                   optimizer_offload_fraction=p.optimizer_offload_fraction if p.optimizer_cpu_offload else 0.0,
                   micro_batch_size=t.micro_batch_size,
                   global_batch_size=t.global_batch_size,
                   seq_length=cfg.rollout.max_prompt_length + cfg.rollout.max_response_length,
                   param_bytes=DTYPE_BYTES[cfg.model.params_dtype],
                   reference=cfg.model.reference != "none", max_tokens_per_microbatch=t.max_tokens_per_microbatch,
                   lora_rank=cfg.lora.rank, lora_targets=tuple(cfg.lora.targets),
                   base_quantization=cfg.lora.base_quantization, lora_dropout=cfg.lora.dropout)

    @property
    def dp(self) -> int:
        return max(1, self.world // (self.tp * self.pp * self.cp))

    @property
    def dense_shards(self) -> int:
        return max(1, self.world // (self.tp * self.pp))

    @property
    def expert_dp(self) -> int:
        return max(1, self.world // (self.pp * self.ep * self.etp))

    @property
    def microbatch_tokens(self) -> int:
        """Tokens of the largest micro-batch: the token budget when set (a sample longer than it
        runs alone), else `micro_batch_size` rows of the full sequence length."""
        if self.max_tokens_per_microbatch is not None:
            return max(self.max_tokens_per_microbatch, self.seq_length)
        return self.micro_batch_size * self.seq_length

    @property
    def num_microbatches(self) -> int:
        # With a budget the count varies per step; at most one sample per micro-batch.
        rows = 1 if self.max_tokens_per_microbatch is not None else self.micro_batch_size
        return max(1, self.global_batch_size // (self.dp * rows))

    def describe(self) -> str:
        rc = {"full": f"full recompute ({self.recompute_method}, {self.recompute_num_layers})",
              "selective": "selective recompute", "none": "no recompute"}[self.recompute]
        vpp = f" VPP{self.vpp}" if self.vpp else ""
        return (f"TP{self.tp} PP{self.pp}{vpp} CP{self.cp} EP{self.ep} ETP{self.etp}"
                f"{' SP' if self.sp else ''} DP{self.dp}, {rc}, "
                f"{'optimizer on CPU' if self.optimizer_offload else 'optimizer on GPU'}, "
                f"{self._microbatch_words()}, {self.num_microbatches} micro-batches/step"
                f"{' at most' if self.max_tokens_per_microbatch is not None else ''}")

    def _microbatch_words(self) -> str:
        if self.max_tokens_per_microbatch is None:
            return f"micro-batch {self.micro_batch_size} × {self.seq_length} tokens"
        return (f"token budget {self.max_tokens_per_microbatch} per micro-batch (activations sized for "
                f"{self.microbatch_tokens} tokens, not micro_batch_size × {self.seq_length})")


@dataclass(frozen=True)
class Term:
    key: str
    label: str
    gb: float
    note: str = ""


@dataclass(frozen=True)
class StageMemory:
    stage: int
    num_layers: int
    terms: tuple[Term, ...]
    host_gb: float
    """Host memory per GPU for offloaded optimizer states (0 when on GPU)."""

    @property
    def total_gb(self) -> float:
        return sum(t.gb for t in self.terms)

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.gb)


def stage_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Balanced split: the first `num_layers % pp` stages take one layer more."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for stage in range(pp):
        n = base + (1 if stage < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_blocks(params: ModelParams, stage: int, pp: int) -> tuple[list[Layer], list[Block]]:
    """Decoder layers and all weight blocks on one pipeline stage. With tied embeddings and PP > 1
    the last stage keeps its own copy of the embedding as the output layer (Megatron)."""
    layers = [params.layers[i] for i in stage_layer_ranges(len(params.layers), pp)[stage]]
    blocks = [b for layer in layers for b in layer.blocks]
    if stage == 0:
        blocks += params.pre
    if stage == pp - 1:
        blocks += params.post
        if params.dims.tied and pp > 1:
            blocks += params.pre
    return layers, blocks


# ----------------------------------------------------------------------------- activations
def _full_attention_elems(d: Dims, gated: bool) -> float:
    a, g, hd = d.heads, d.kv_heads, d.head_dim
    return (a + g) * hd + (a + 2 * g) * hd + a * hd + (2 * a * hd if gated else 0)


def _linear_attention_elems(d: Dims, gated: bool) -> float:
    kd, vd, nv = d.lin_key_heads * d.lin_key_dim, d.lin_value_heads * d.lin_value_dim, d.lin_value_heads
    return (2 * kd + 2 * vd + 2 * nv) + 2 * d.lin_conv_dim + 4 * nv + 2 * vd


MIXER_ACTIVATIONS: dict[str, Callable[[Dims, bool], float]] = {
    "full_attention": _full_attention_elems,
    "linear_attention": _linear_attention_elems,
}


def layer_activation_bytes(layer: Layer, params: ModelParams, lay: Layout) -> float:
    """Bytes one micro-batch leaves on one GPU for this layer without recompute."""
    d, gated = params.dims, params.spec.gated_attention
    tokens = lay.microbatch_tokens / lay.cp
    r = lay.tp if lay.sp else 1
    per_token = 4 * d.hidden / r + MIXER_ACTIVATIONS[layer.mixer](d, gated) / lay.tp
    extra = tokens * lora_dropout_bytes_per_token(layer, d, lay)
    if layer.ffn == "dense":
        return 2 * tokens * (per_token + 3 * d.intermediate / lay.tp) + extra
    per_token += 2 * d.experts / r + (3 * d.shared_intermediate / lay.tp + d.hidden / r
                                      if d.shared_intermediate else 0)
    routed = d.top_k * lay.etp * (2 * d.hidden + 3 * d.moe_intermediate / lay.etp)
    return 2 * tokens * per_token + 2 * (tokens / r) * routed + extra


def lora_dropout_bytes_per_token(layer: Layer, d: Dims, lay: Layout) -> float:
    """LoRA dropout (`lora.dropout` > 0) on a full-attention layer: each of q, k, v keeps its own
    dropped copy of the layer input (bf16) and its bool mask (the sequence chunk under SP), o one of
    its TP share of the attention output; without dropout the adapters read the base's saved input."""
    if not (lay.lora_rank and lay.lora_dropout > 0 and layer.mixer == "full_attention"):
        return 0.0
    per_element = lay.param_bytes + 1
    r = lay.tp if lay.sp else 1
    qkv = sum(t in lay.lora_targets for t in ("q", "k", "v")) * d.hidden / r
    o = d.heads * d.head_dim / lay.tp if "o" in lay.lora_targets else 0.0
    return per_element * (qkv + o)


def stage_activation_bytes(layers: Sequence[Layer], params: ModelParams, lay: Layout,
                           in_flight: float) -> float:
    full = [layer_activation_bytes(layer, params, lay) for layer in layers]
    if not full:
        return 0.0
    tokens = lay.microbatch_tokens / lay.cp
    checkpoint = 2 * tokens * params.dims.hidden / (lay.tp if lay.sp else 1)
    n = max(1, lay.recompute_num_layers)
    if lay.recompute != "full":
        stored, working = sum(full), max(full)
    elif lay.recompute_method == "uniform":
        chunks = [full[i:i + n] for i in range(0, len(full), n)]
        stored, working = len(chunks) * checkpoint, max(sum(c) for c in chunks)
    else:
        n = min(n, len(full))
        stored, working = n * checkpoint + sum(full[n:]), max(full)
    return stored * in_flight + working


def in_flight_microbatches(lay: Layout, stage: int) -> float:
    count = float(min(lay.pp - stage, lay.num_microbatches))
    if lay.vpp and stage == 0 and lay.pp > 1:
        count *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    return count


# ----------------------------------------------------------------------------- trainer terms
def _sharded(blocks: Sequence[Block], lay: Layout) -> tuple[float, float]:
    dense = sum(b.per_gpu(lay.tp, lay.ep, lay.etp) for b in blocks if b.shard is not Shard.EXPERT)
    expert = sum(b.per_gpu(lay.tp, lay.ep, lay.etp) for b in blocks if b.shard is Shard.EXPERT)
    return dense, expert


def optimizer_bytes(dense: float, expert: float, lay: Layout) -> float:
    per_param = ADAM_STATE_BYTES + (MASTER_WEIGHT_BYTES if lay.param_bytes < 4 else 0)
    if not lay.distributed_optimizer:
        return per_param * (dense + expert)
    return per_param * (dense / lay.dense_shards + expert / lay.expert_dp)


ExtraTerms = Callable[[int, float], Sequence[Term]]
"""(stage, in-flight micro-batches) → GPU terms outside the model state (`host.gpu_extra_terms`)."""


def stage_memory(params: ModelParams, lay: Layout, stage: int, colocated_vllm_gb: float,
                 extra: ExtraTerms | None = None) -> StageMemory:
    layers, blocks = stage_blocks(params, stage, lay.pp)
    dense, expert = _sharded(blocks, lay)
    n = dense + expert
    sp = stage_params(params, layers, blocks, lay.tp, lay.ep, lay.etp, lay.param_bytes, lay.lora_rank,
                      lay.lora_targets, lay.base_quantization)
    trained = sp.trainable_dense + sp.trainable_expert
    optimizer = optimizer_bytes(sp.trainable_dense, sp.trainable_expert, lay)
    on_host = optimizer * lay.optimizer_offload_fraction
    acts = stage_activation_bytes(layers, params, lay, in_flight_microbatches(lay, stage))
    logits = 0.0
    if stage == lay.pp - 1:
        logits = 6 * lay.microbatch_tokens / lay.cp * params.dims.vocab / lay.tp
    terms = [
        Term("weights", "actor weights", sp.weight_bytes / GB, _weights_note(n, sp, lay)),
        Term("gradients", "gradients (fp32 main grads)", trained * GRAD_BYTES / GB),
        Term("optimizer", "optimizer (Adam m, v, fp32 master)",
             (optimizer - on_host) / GB,
             f"offloaded: {on_host / GB:.1f} GB in host memory" if lay.optimizer_offload else ""),
        Term("activations", "activations", acts / GB,
             f"{len(layers)} layers × {in_flight_microbatches(lay, stage):g} micro-batch(es) "
             "in flight"),
        Term("logits", "logits (last stage)", logits / GB),
        # With LoRA the reference is the base with the adapters off: no second copy.
        Term("reference", "reference model (bf16)",
             n * lay.param_bytes / GB if lay.reference and not lay.lora_rank else 0.0),
        Term("dequantized", "dequantized base weight (transient)", sp.transient_bytes / GB),
        Term("vllm", "vLLM (colocated)", colocated_vllm_gb),
        Term("overhead", "CUDA context, NCCL, fragmentation", OVERHEAD_GB),
        *(extra(stage, in_flight_microbatches(lay, stage)) if extra else ()),
    ]
    return StageMemory(stage, len(layers), tuple(terms), on_host / GB)


def _weights_note(n: float, sp: StageParams, lay: Layout) -> str:
    if not lay.lora_rank:
        return f"{n / 1e9:.2f} B params on this GPU"
    quant = f", {sp.quantized / 1e9:.2f} B of it in {lay.base_quantization}" if sp.quantized else ""
    return (f"frozen base {sp.frozen / 1e9:.2f} B params{quant}; "
            f"LoRA r{lay.lora_rank} adapters {sp.trainable_dense / 1e6:.1f} M")


def worst_stage(params: ModelParams, lay: Layout, colocated_vllm_gb: float,
                extra: ExtraTerms | None = None) -> StageMemory:
    if lay.pp > len(params.layers):
        raise PlannerError(f"pipeline size {lay.pp} exceeds the model's {len(params.layers)} layers")
    stages = {0, lay.pp - 1}
    return max((stage_memory(params, lay, s, colocated_vllm_gb, extra) for s in sorted(stages)),
               key=lambda m: m.total_gb)


# ----------------------------------------------------------------------------- rollout (vLLM)
@dataclass(frozen=True)
class RolloutMemory:
    placement: str
    tp: int
    dp: int
    ep: int
    gpus: int
    """GPUs the servers run on: servers × TP × DP."""
    servers: int
    """One per rollout node (the trainer's nodes when colocated); 0 when a server does not fit a node."""
    reserved_gb: float
    weights_gb: float
    runtime_gb: float
    kv_budget_gb: float
    sequence_gb: float
    """KV cache (and Gated DeltaNet state) of one max-length sequence on one GPU."""
    problem: str = ""
    kv_token_bytes: float = 0.0
    """KV cache of one token on one GPU (the full-attention layers)."""
    state_bytes: float = 0.0
    """Fixed Gated DeltaNet conv + recurrent state of one sequence on one GPU."""
    expert_weights_gb: float = 0.0
    """Of `weights_gb`, the routed experts' share (read only when a token routes to them)."""

    @property
    def sequences_per_server(self) -> float:
        """Max-length sequences the KV cache holds at once: each of the DP attention replicas keeps
        its own sequences on its TP GPUs."""
        return max(0.0, self.dp * self.kv_budget_gb / self.sequence_gb) if self.sequence_gb else 0.0

    @property
    def fits(self) -> bool:
        return not self.problem and self.kv_budget_gb >= self.sequence_gb


def rollout_memory(params: ModelParams, cfg: RecipeConfig, hw: Hardware) -> RolloutMemory:
    r, d = cfg.rollout, params.dims
    tp, dp = r.tensor_parallel_size, r.data_parallel_size
    ep = tp * dp if r.enable_expert_parallel else tp
    nbytes = DTYPE_BYTES[r.dtype]
    blocks = list(params.blocks())
    dense = sum(b.params for b in blocks if b.shard is not Shard.EXPERT)
    experts = sum(b.params for b in blocks if b.shard is Shard.EXPERT)
    weights = nbytes * (dense / tp + experts / ep) / GB
    expert_weights = nbytes * experts / ep / GB
    full = sum(1 for layer in params.layers if layer.mixer == "full_attention")
    linear = len(params.layers) - full
    kv_token = full * 2 * max(1, d.kv_heads // tp) * d.head_dim * nbytes
    gdn_state = linear * ((d.lin_conv_dim / tp) * max(0, d.conv_kernel - 1)
                          + (d.lin_value_heads / tp) * d.lin_key_dim * d.lin_value_dim) * nbytes
    max_len = r.max_prompt_length + r.max_response_length
    # One server per node, on TP × DP of its GPUs: the trainer's node-first ranks start them when
    # colocated (train/fleet.py), the sbatch script's rollout step when disaggregated.
    servers = cfg.parallelism.nodes if r.placement == "colocated" else r.nodes
    reserved = r.gpu_memory_utilization * hw.gpu_memory_gb
    problem = ""
    if tp * dp > hw.gpus_per_node:
        problem = (f"one server of vLLM TP×DP = {tp * dp} GPUs does not fit a node of {hw.gpus_per_node} "
                   "(servers run one per node)")
    elif servers == 0:
        problem = "no nodes for rollout"
    gpus = servers * tp * dp
    return RolloutMemory(r.placement, tp, dp, ep, gpus, servers if not problem else 0,
                         reserved, weights, VLLM_RUNTIME_GB, reserved - weights - VLLM_RUNTIME_GB,
                         (max_len * kv_token + gdn_state) / GB, problem, kv_token, gdn_state, expert_weights)


def reserved_by_colocated_vllm(cfg: RecipeConfig, hw: Hardware) -> float:
    if cfg.rollout.placement != "colocated":
        return 0.0
    return cfg.rollout.gpu_memory_utilization * hw.gpu_memory_gb

