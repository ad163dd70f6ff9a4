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
* logits (last stage): with `trainer.fused_lm_head` (the default) the fused head's working set,
  one chunk of rows at a time (`fused_head.default_chunk_rows`: a bf16 logits/gradient chunk and two
  fp32 temporaries, 10 bytes per entry of ``[chunk, vocab/TP]``), whatever the micro-batch's length;
  without it, bf16 logits plus fp32 log-softmax over the vocab-parallel shard (6 bytes per entry of
  ``[tokens, vocab/TP]``), and on GPU Transformer-Engine 2.18's ``parallel_cross_entropy`` in the
  forwards without entropy (π_old, π_ref, verification) allocates a full fp32 gradient buffer, also
  under ``no_grad`` (`transformer_engine/pytorch/triton/cross_entropy.py`): 4 more bytes per entry,
  the "TE cross-entropy fp32 buffer" term (3.5 GB with the logits at 4,608 tokens × 151,936 / TP 2).
  Those passes keep no activations, so summing it into the training peak is conservative (audit 3 #14);
* reference model: bf16 weights sharded like the actor, whenever the run has one
  (`algorithm.uses_reference`: a KL term, the trainer's rule);
* vLLM, when colocated: vLLM claims `gpu_memory_utilization` × the card for weights + KV cache;
* overhead: OVERHEAD_GB (CUDA context and cuBLAS workspaces ~1 GB, NCCL buffers of the
  TP/PP/DP/EP/CP communicators ~2 GB, caching-allocator fragmentation ~1 GB).

With `lora.rank` > 0 the weights are a frozen base (in NF4 with `base_quantization: nf4`) plus
adapters, and only the adapters have gradients and optimizer states; the reference is the base
with the adapters off (no term); see `lora.py`. Two moments outside the step are checked apart
(`lora_peaks`, not summed into the step): QLoRA's start-up, when the stage is built unquantized, and
each sync, when the adapted base weights are dense (QLoRA: dequantized, plus the copy restored after).

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

from ..config.schema import LoraConfig, ParallelismConfig, RecipeConfig
from ..fused_head import default_chunk_rows
from .lora import StageParams, merged_copy_params, stage_params
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


# ----------------------------------------------------------------------------- the recipe's numbers
def seq_length(cfg: RecipeConfig) -> int:
    """A padded row: max_prompt_length + max_response_length."""
    return cfg.rollout.max_prompt_length + cfg.rollout.max_response_length


def param_bytes(cfg: RecipeConfig) -> int:
    """Bytes of one parameter in the training dtype."""
    return DTYPE_BYTES[cfg.model.params_dtype]


def dense_shards(p: ParallelismConfig) -> int:
    """Ranks the distributed optimizer shards a dense parameter over: DP × CP = world / (TP·PP) (CP
    ranks hold identical weights)."""
    return max(1, p.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size))


def expert_dp(p: ParallelismConfig) -> int:
    """The expert-data-parallel group an expert parameter is sharded over: world / (PP·EP·ETP)."""
    return max(1, p.world_size // (p.pipeline_model_parallel_size * p.expert_model_parallel_size * p.expert_tp))


def offloaded_fraction(p: ParallelismConfig) -> float:
    """Share of the optimizer states in host memory (0 unless `optimizer_cpu_offload`)."""
    return p.optimizer_offload_fraction if p.optimizer_cpu_offload else 0.0


def microbatch_tokens(cfg: RecipeConfig) -> int:
    """Tokens of the largest micro-batch: the token budget when set (a sample longer than it
    runs alone), else `micro_batch_size` rows of the full sequence length."""
    budget = cfg.trainer.max_tokens_per_microbatch
    if budget is not None:
        return max(budget, seq_length(cfg))
    return cfg.trainer.micro_batch_size * seq_length(cfg)


def num_microbatches(cfg: RecipeConfig) -> int:
    # With a budget the count varies per step; at most one sample per micro-batch.
    t = cfg.trainer
    rows = 1 if t.max_tokens_per_microbatch is not None else t.micro_batch_size
    return max(1, t.global_batch_size // (cfg.parallelism.data_parallel_size * rows))


def describe(cfg: RecipeConfig) -> str:
    """The trainer's layout in one line (`plan`'s header and JSON `layout`)."""
    p = cfg.parallelism
    rc = {"full": f"full recompute ({p.recompute_method}, {p.recompute_num_layers})",
          "selective": "selective recompute", "none": "no recompute"}[p.recompute_granularity]
    vpp = f" VPP{p.virtual_pipeline_model_parallel_size}" if p.virtual_pipeline_model_parallel_size else ""
    return (f"TP{p.tensor_model_parallel_size} PP{p.pipeline_model_parallel_size}{vpp} "
            f"CP{p.context_parallel_size} EP{p.expert_model_parallel_size} ETP{p.expert_tp}"
            f"{' SP' if p.sequence_parallel else ''} DP{p.data_parallel_size}, {rc}, "
            f"{'optimizer on CPU' if p.optimizer_cpu_offload else 'optimizer on GPU'}, "
            f"{_microbatch_words(cfg)}, {num_microbatches(cfg)} micro-batches/step"
            f"{' at most' if cfg.trainer.max_tokens_per_microbatch is not None else ''}")


def _microbatch_words(cfg: RecipeConfig) -> str:
    budget, seq = cfg.trainer.max_tokens_per_microbatch, seq_length(cfg)
    if budget is None:
        return f"micro-batch {cfg.trainer.micro_batch_size} × {seq} tokens"
    return (f"token budget {budget} per micro-batch (activations sized for "
            f"{microbatch_tokens(cfg)} tokens, not micro_batch_size × {seq})")


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


def layer_activation_bytes(layer: Layer, params: ModelParams, cfg: RecipeConfig) -> float:
    """Bytes one micro-batch leaves on one GPU for this layer without recompute."""
    d, gated, p = params.dims, params.spec.gated_attention, cfg.parallelism
    tp, etp = p.tensor_model_parallel_size, p.expert_tp
    tokens = microbatch_tokens(cfg) / p.context_parallel_size
    r = tp if p.sequence_parallel else 1
    per_token = 4 * d.hidden / r + MIXER_ACTIVATIONS[layer.mixer](d, gated) / tp
    extra = tokens * lora_dropout_bytes_per_token(layer, d, cfg)
    if layer.ffn == "dense":
        return 2 * tokens * (per_token + 3 * d.intermediate / tp) + extra
    per_token += 2 * d.experts / r + (3 * d.shared_intermediate / tp + d.hidden / r
                                      if d.shared_intermediate else 0)
    routed = d.top_k * etp * (2 * d.hidden + 3 * d.moe_intermediate / etp)
    return 2 * tokens * per_token + 2 * (tokens / r) * routed + extra


def lora_dropout_bytes_per_token(layer: Layer, d: Dims, cfg: RecipeConfig) -> float:
    """LoRA dropout (`lora.dropout` > 0) on a full-attention layer: each of q, k, v keeps its own
    dropped copy of the layer input (bf16) and its bool mask (the sequence chunk under SP), o one of
    its TP share of the attention output; without dropout the adapters read the base's saved input."""
    lo, p = cfg.lora, cfg.parallelism
    if not (lo.rank and lo.dropout > 0 and layer.mixer == "full_attention"):
        return 0.0
    per_element = param_bytes(cfg) + 1
    tp = p.tensor_model_parallel_size
    r = tp if p.sequence_parallel else 1
    qkv = sum(t in lo.targets for t in ("q", "k", "v")) * d.hidden / r
    o = d.heads * d.head_dim / tp if "o" in lo.targets else 0.0
    return per_element * (qkv + o)


def stage_activation_bytes(layers: Sequence[Layer], params: ModelParams, cfg: RecipeConfig,
                           in_flight: float) -> float:
    full = [layer_activation_bytes(layer, params, cfg) for layer in layers]
    if not full:
        return 0.0
    p = cfg.parallelism
    tokens = microbatch_tokens(cfg) / p.context_parallel_size
    checkpoint = 2 * tokens * params.dims.hidden / (p.tensor_model_parallel_size if p.sequence_parallel else 1)
    n = max(1, p.recompute_num_layers)
    if p.recompute_granularity != "full":
        stored, working = sum(full), max(full)
    elif p.recompute_method == "uniform":
        chunks = [full[i:i + n] for i in range(0, len(full), n)]
        stored, working = len(chunks) * checkpoint, max(sum(c) for c in chunks)
    else:
        n = min(n, len(full))
        stored, working = n * checkpoint + sum(full[n:]), max(full)
    return stored * in_flight + working


def in_flight_microbatches(cfg: RecipeConfig, stage: int) -> float:
    pp, vpp = cfg.parallelism.pipeline_model_parallel_size, cfg.parallelism.virtual_pipeline_model_parallel_size
    count = float(min(pp - stage, num_microbatches(cfg)))
    if vpp and stage == 0 and pp > 1:
        count *= 1 + (pp - 1) / (pp * vpp)
    return count


# ----------------------------------------------------------------------------- trainer terms
def _sharded(blocks: Sequence[Block], p: ParallelismConfig) -> tuple[float, float]:
    tp, ep, etp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_tp
    dense = sum(b.per_gpu(tp, ep, etp) for b in blocks if b.shard is not Shard.EXPERT)
    expert = sum(b.per_gpu(tp, ep, etp) for b in blocks if b.shard is Shard.EXPERT)
    return dense, expert


def optimizer_bytes(dense: float, expert: float, cfg: RecipeConfig) -> float:
    p = cfg.parallelism
    per_param = ADAM_STATE_BYTES + (MASTER_WEIGHT_BYTES if param_bytes(cfg) < 4 else 0)
    if not p.use_distributed_optimizer:
        return per_param * (dense + expert)
    return per_param * (dense / dense_shards(p) + expert / expert_dp(p))


# The fused head holds a bf16 logits chunk (reused for its gradient in backward) and two fp32
# temporaries of the same shape (`logprobs._forward_chunk` / `_backward_chunk`).
FUSED_BYTES_PER_LOGIT = 2 + 4 + 4
LOGITS_BYTES_PER_LOGIT = 6          # bf16 logits + fp32 log-softmax
TE_BUFFER_BYTES_PER_LOGIT = 4       # TE 2.18's fp32 gradient buffer (audit 3, finding 14)


def logits_bytes(cfg: RecipeConfig, vocab: int) -> tuple[float, float]:
    """(logits working set, TE's extra buffer) of the last stage, per GPU."""
    p = cfg.parallelism
    tokens = microbatch_tokens(cfg) / p.context_parallel_size
    shard = vocab / p.tensor_model_parallel_size
    if cfg.trainer.fused_lm_head:
        rows = min(tokens, default_chunk_rows(int(shard)))
        return FUSED_BYTES_PER_LOGIT * rows * shard, 0.0
    return LOGITS_BYTES_PER_LOGIT * tokens * shard, TE_BUFFER_BYTES_PER_LOGIT * tokens * shard


ExtraTerms = Callable[[int, float], Sequence[Term]]
"""(stage, in-flight micro-batches) → GPU terms outside the model state (`host.gpu_extra_terms`)."""


def stage_memory(params: ModelParams, cfg: RecipeConfig, stage: int, colocated_vllm_gb: float,
                 extra: ExtraTerms | None = None) -> StageMemory:
    p, lo, nbytes = cfg.parallelism, cfg.lora, param_bytes(cfg)
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    layers, blocks = stage_blocks(params, stage, pp)
    dense, expert = _sharded(blocks, p)
    n = dense + expert
    sp = stage_params(params, layers, blocks, tp, p.expert_model_parallel_size, p.expert_tp, nbytes, lo.rank,
                      tuple(lo.targets), lo.base_quantization)
    trained = sp.trainable_dense + sp.trainable_expert
    optimizer = optimizer_bytes(sp.trainable_dense, sp.trainable_expert, cfg)
    on_host = optimizer * offloaded_fraction(p)
    in_flight = in_flight_microbatches(cfg, stage)
    acts = stage_activation_bytes(layers, params, cfg, in_flight)
    logits, te_buffer = logits_bytes(cfg, params.dims.vocab) if stage == pp - 1 else (0.0, 0.0)
    terms = [
        Term("weights", "actor weights", sp.weight_bytes / GB, _weights_note(n, sp, lo)),
        Term("gradients", "gradients (fp32 main grads)", trained * GRAD_BYTES / GB),
        Term("optimizer", "optimizer (Adam m, v, fp32 master)",
             (optimizer - on_host) / GB,
             f"offloaded: {on_host / GB:.1f} GB in host memory" if p.optimizer_cpu_offload else ""),
        Term("activations", "activations", acts / GB,
             f"{len(layers)} layers × {in_flight:g} micro-batch(es) in flight"),
        Term("logits", "logits (last stage)", logits / GB,
             "fused head: one chunk at a time" if cfg.trainer.fused_lm_head and logits else ""),
        Term("te_buffer", "TE cross-entropy fp32 buffer", te_buffer / GB,
             "trainer.fused_lm_head false: TE's kernel in the forwards without entropy" if te_buffer else ""),
        # With LoRA the reference is the base with the adapters off: no second copy.
        Term("reference", "reference model (bf16)",
             n * nbytes / GB if cfg.algorithm.uses_reference and not lo.rank else 0.0),
        Term("dequantized", "dequantized base weight (transient)", sp.transient_bytes / GB),
        Term("vllm", "vLLM (colocated)", colocated_vllm_gb),
        Term("overhead", "CUDA context, NCCL, fragmentation", OVERHEAD_GB),
        *(extra(stage, in_flight) if extra else ()),
    ]
    return StageMemory(stage, len(layers), tuple(terms), on_host / GB)


def _weights_note(n: float, sp: StageParams, lo: LoraConfig) -> str:
    if not lo.rank:
        return f"{n / 1e9:.2f} B params on this GPU"
    quant = f", {sp.quantized / 1e9:.2f} B of it in {lo.base_quantization}" if sp.quantized else ""
    return (f"frozen base {sp.frozen / 1e9:.2f} B params{quant}; "
            f"LoRA r{lo.rank} adapters {sp.trainable_dense / 1e6:.1f} M")


def worst_stage(params: ModelParams, cfg: RecipeConfig, colocated_vllm_gb: float,
                extra: ExtraTerms | None = None) -> StageMemory:
    pp = cfg.parallelism.pipeline_model_parallel_size
    if pp > len(params.layers):
        raise PlannerError(f"pipeline size {pp} exceeds the model's {len(params.layers)} layers")
    stages = {0, pp - 1}
    return max((stage_memory(params, cfg, s, colocated_vllm_gb, extra) for s in sorted(stages)),
               key=lambda m: m.total_gb)


RESIDENT_AT_SYNC: tuple[str, ...] = ("weights", "gradients", "optimizer", "reference", "vllm", "overhead",
                                     "sync_gather", "sync_bucket")
"""The terms still held when a sync runs (after the step: activations, logits and log-probs are
freed, and their blocks in the allocator's cache serve the merged copies)."""


def lora_peaks(params: ModelParams, cfg: RecipeConfig, colocated_vllm_gb: float,
               extra: ExtraTerms | None = None) -> tuple[Term, ...]:
    """A LoRA trainer's GPU at two moments outside the step (worst of the first and last stage):

    * QLoRA's start-up: the stage is built in the training dtype on its GPU and quantized after
      (`megatron/actor.py`), so the whole bf16 base is there once, before any server starts;
    * each sync: `merged_deltas` holds every adapted base weight of the GPU densely, plus a saved
      copy to restore it — with a quantized base that is two dense copies (dequantized + saved)
      where the step had none."""
    lo, p, nbytes = cfg.lora, cfg.parallelism, param_bytes(cfg)
    if not lo.rank:
        return ()
    pp = p.pipeline_model_parallel_size
    tp, ep, etp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_tp
    quantized = lo.base_quantization != "none"
    start: list[Term] = []
    sync: list[Term] = []
    for stage in sorted({0, pp - 1}):
        layers, blocks = stage_blocks(params, stage, pp)
        dense = stage_params(params, layers, blocks, tp, ep, etp, nbytes, lo.rank, tuple(lo.targets), "none")
        start.append(Term("startup", "start-up, before quantization", dense.weight_bytes / GB + OVERHEAD_GB,
                          f"stage {stage}: {dense.weight_bytes / GB:.1f} GB of {dense.frozen / 1e9:.2f} B params "
                          "unquantized + overhead, before the servers start"))
        copies = merged_copy_params(params.dims, params.spec.gated_attention, layers, tuple(lo.targets), tp, ep, etp)
        copy_gb = (2 if quantized else 1) * copies * nbytes / GB
        resident = sum(t.gb for t in stage_memory(params, cfg, stage, colocated_vllm_gb, extra).terms
                       if t.key in RESIDENT_AT_SYNC)
        sync.append(Term("sync_copies", "sync: dense adapted weights", resident + copy_gb,
                         f"stage {stage}: {copy_gb:.1f} GB of {'2' if quantized else '1'} × {copies / 1e9:.2f} B "
                         f"params ({'dequantized + saved' if quantized else 'saved'}) + what a sync holds"))
    worst = [max(sync, key=lambda t: t.gb)]
    return tuple(([max(start, key=lambda t: t.gb)] if quantized else []) + worst)


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

