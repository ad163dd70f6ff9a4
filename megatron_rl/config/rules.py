"""Cross-field recipe checks that catch mistakes seen in the field.

Each rule is a function `(cfg, hf) -> list[Finding]` registered with `@rule`; `hf` is the model's
HF config (or None when the recipe names no model). Findings are errors unless a rule marks them
as warnings; `recipe validate` exits non-zero on any error. Every command runs them through
`check.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..model_config import ModelConfigError, num_experts, read_hf_config, resolve_hf_config
from ..topology import duplicate_gpus, nccl_weight_group, weight_copy_path
from .schema import RecipeConfig, RolloutConfig

Level = Literal["error", "warning"]
HF = dict[str, Any] | None


@dataclass(frozen=True)
class Finding:
    level: Level
    rule: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: [{self.rule}] {self.key}: {self.message}"


RuleFn = Callable[[RecipeConfig, HF], list[Finding]]
RULES: dict[str, RuleFn] = {}

SEQUENCE_RATIO_OBJECTIVES = ("gspo", "gspo_token")


def rule(name: str) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        RULES[name] = fn
        return fn
    return register


@rule("gspo-never-clips")
def _gspo_spg(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    # A warning, not an error: article 000's QLoRA run was exactly this (ms-swift's transformers
    # trainer counts steps_per_generation 2 in micro-steps of gradient accumulation 4, so each
    # optimizer step trained on completions of its own weights), and recipes/qwen3_235b_a22b/
    # gspo_qlora.yaml reproduces it.
    if cfg.algorithm.rl_objective in SEQUENCE_RATIO_OBJECTIVES and cfg.algorithm.steps_per_generation == 1:
        return [Finding("warning", "gspo-never-clips", "algorithm.steps_per_generation",
                        "GSPO with steps_per_generation 1 is on-policy: the sequence ratio is always 1, "
                        "the clip never acts and the gradient is GRPO's (sequence-mean). That is what article "
                        "000's QLoRA run did (ms-swift: steps_per_generation 2 micro-steps within gradient "
                        "accumulation 4); use >= 2 for GSPO's clipping (article 001's GSPO uses 3)")]
    return []


@rule("sequence-ratio-eps")
def _seq_eps(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    a = cfg.algorithm
    eps = max(a.clip_eps_low, a.clip_eps_high)
    if a.rl_objective in SEQUENCE_RATIO_OBJECTIVES and eps >= 0.01:
        return [Finding("warning", "sequence-ratio-eps", "algorithm.clip_eps_high",
                        f"a sequence-level ratio with clip ε {eps:g} >= 0.01 almost never clips; "
                        "GSPO's paper uses 3e-4 / 4e-4")]
    return []


@rule("kl-needs-reference")
def _kl_reference(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    a, m = cfg.algorithm, cfg.model
    out: list[Finding] = []
    if a.uses_reference and m.reference == "none":
        out.append(Finding("error", "kl-needs-reference", "model.reference",
                           f"algorithm.kl_beta is {a.kl_beta:g} but model.reference is 'none'; "
                           "set model.reference to 'init' or 'path'"))
    if m.reference == "path" and not m.reference_path:
        out.append(Finding("error", "kl-needs-reference", "model.reference_path",
                           "model.reference is 'path' but model.reference_path is not set"))
    if a.kl_in_reward and a.kl_beta == 0:
        out.append(Finding("warning", "kl-needs-reference", "algorithm.kl_in_reward",
                           "kl_in_reward is set but kl_beta is 0: no KL penalty is applied"))
    return out


@rule("chord-needs-sft-data")
def _chord_sft(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    if cfg.algorithm.name == "chord" and not cfg.data.sft_path:
        return [Finding("error", "chord-needs-sft-data", "data.sft_path",
                        "CHORD mixes in an SFT loss on expert data; set data.sft_path")]
    return []


def _divides(key: str, divisor: int, total: int, what: str) -> list[Finding]:
    if divisor and total % divisor:
        return [Finding("error", "parallel-sizes", key, f"{divisor} does not divide {what} ({total})")]
    return []


@rule("parallel-sizes")
def _parallel(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    p = cfg.parallelism
    world, etp = p.world_size, p.expert_tp
    tp, pp, cp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size, p.expert_model_parallel_size)
    out = _divides("parallelism.tensor_model_parallel_size", tp * pp * cp, world,
                   "the world size nodes × gpus_per_node (TP × PP × CP must divide it)")
    out += _divides("parallelism.expert_model_parallel_size", ep * etp, world // pp,
                    "world size / PP (EP × ETP must divide it)")
    if hf is not None:
        heads = int(hf.get("num_attention_heads", tp))
        out += _divides("parallelism.tensor_model_parallel_size", tp, heads, "the model's num_attention_heads")
        out += _divides("parallelism.tensor_model_parallel_size", tp, int(hf.get("num_key_value_heads", heads)),
                        "the model's num_key_value_heads (Megatron's query groups)")
        out += _divides("parallelism.pipeline_model_parallel_size", pp,
                        int(hf.get("num_hidden_layers", pp)), "the model's num_hidden_layers")
        experts = num_experts(hf)
        if experts:
            out += _divides("parallelism.expert_model_parallel_size", ep, experts, "the model's num_experts")
            if tp > 1 and not p.sequence_parallel:
                out.append(Finding("error", "parallel-sizes", "parallelism.sequence_parallel",
                                   "Megatron requires sequence_parallel with TP > 1 on MoE models"))
        elif ep > 1:
            out.append(Finding("error", "parallel-sizes", "parallelism.expert_model_parallel_size",
                               f"expert parallelism {ep} on a dense model"))
    return out


@rule("batch-sizes")
def _batch(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    t, r = cfg.trainer, cfg.rollout
    dp = cfg.parallelism.data_parallel_size
    out: list[Finding] = []
    mbs = 1 if t.max_tokens_per_microbatch is not None else t.micro_batch_size   # budget: any rows per micro-batch
    if t.global_batch_size % (dp * mbs):
        out.append(Finding("error", "batch-sizes", "trainer.global_batch_size",
                           f"{t.global_batch_size} is not divisible by DP × micro_batch_size "
                           f"= {dp} × {mbs}"))
    rollout_batch = t.global_batch_size * cfg.algorithm.steps_per_generation
    if rollout_batch % r.n:
        out.append(Finding("error", "batch-sizes", "rollout.n",
                           f"{r.n} generations per prompt do not divide the rollout batch "
                           f"global_batch_size × steps_per_generation = {rollout_batch}"))
    return out


@rule("token-budget")
def _token_budget(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    t, r, p = cfg.trainer, cfg.rollout, cfg.parallelism
    out: list[Finding] = []
    budget = t.max_tokens_per_microbatch
    if budget is None:
        return out
    longest = r.max_prompt_length + r.max_response_length
    if budget < longest:
        out.append(Finding("warning", "token-budget", "trainer.max_tokens_per_microbatch",
                           f"{budget} tokens cannot hold one max-length sample ({longest} = max_prompt_length "
                           "+ max_response_length); such a sample gets a micro-batch of its own, over budget"))
    default_mbs = type(t).__dataclass_fields__["micro_batch_size"].default
    if t.micro_batch_size != default_mbs:
        out.append(Finding("warning", "token-budget", "trainer.micro_batch_size",
                           f"{t.micro_batch_size} is not used when max_tokens_per_microbatch is set"))
    if p.moe_token_dispatcher_type == "allgather" and p.expert_model_parallel_size > 1:
        out.append(Finding("error", "token-budget", "parallelism.moe_token_dispatcher_type",
                           "token-budget micro-batches give expert-parallel ranks different token counts; "
                           "the 'allgather' dispatcher cannot exchange them: use 'alltoall'"))
    return out


@rule("chord-sft-split")
def _chord_sft_split(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    n, dp = cfg.algorithm.chord.sft_batch_size, cfg.parallelism.data_parallel_size
    if cfg.algorithm.name == "chord" and n % dp:
        return [Finding("error", "chord-sft-split", "algorithm.chord.sft_batch_size",
                        f"{n} expert rows per optimizer step do not split over the {dp} data-parallel "
                        f"ranks; use a multiple of {dp}")]
    return []


@rule("memory-options")
def _memory_options(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    p, out = cfg.parallelism, []
    if p.optimizer_cpu_offload and not p.use_distributed_optimizer:
        out.append(Finding("error", "memory-options", "parallelism.optimizer_cpu_offload",
                           "megatron-core offloads the distributed optimizer's shards; set "
                           "parallelism.use_distributed_optimizer: true"))
    if p.optimizer_cpu_offload and cfg.model.params_dtype == "fp32":
        out.append(Finding("error", "memory-options", "parallelism.optimizer_cpu_offload",
                           "megatron-core offloads the fp32 master copy of bf16 weights; with "
                           "model.params_dtype fp32 there is none (use bf16)"))
    if p.overlap_param_gather and not p.use_distributed_optimizer:
        out.append(Finding("error", "memory-options", "parallelism.overlap_param_gather",
                           "the parameter all-gather exists only with use_distributed_optimizer: true"))
    if p.pipeline_model_parallel_size > 1 and p.moe_token_dispatcher_type == "allgather":
        out.append(Finding("error", "memory-options", "parallelism.moe_token_dispatcher_type",
                           "pipeline stages exchange micro-batches of different sizes (CHORD's expert rows), "
                           "which megatron-core's allgather dispatcher refuses; use alltoall"))
    if hf is not None and p.recompute_granularity == "full" and p.recompute_method == "block":
        per_stage = int(hf.get("num_hidden_layers", 0)) // p.pipeline_model_parallel_size
        if p.recompute_num_layers > per_stage:
            out.append(Finding("error", "memory-options", "parallelism.recompute_num_layers",
                               f"block recompute of {p.recompute_num_layers} layers, but a pipeline stage "
                               f"has {per_stage}"))
    return out


@rule("eval-needs-data")
def _eval_data(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    e, d = cfg.evaluation, cfg.data
    if e.interval and not d.eval_path:
        return [Finding("error", "eval-needs-data", "data.eval_path",
                        f"evaluation.interval is {e.interval} but data.eval_path is not set")]
    if d.eval_path and not e.interval:
        return [Finding("warning", "eval-needs-data", "evaluation.interval",
                        "data.eval_path is set but evaluation.interval is 0: it is never evaluated")]
    return []


@rule("rollout-placement")
def _placement(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    r = cfg.rollout
    if r.placement == "disaggregated" and r.nodes == 0:
        return [Finding("error", "rollout-placement", "rollout.nodes",
                        "disaggregated rollout needs rollout.nodes >= 1")]
    if r.placement == "colocated" and r.nodes:
        return [Finding("error", "rollout-placement", "rollout.nodes",
                        f"rollout.nodes is {r.nodes} but placement is 'colocated' (set it to 0)")]
    return []


@rule("weight-transfer")
def _weight_transfer(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    """What NCCL and CUDA IPC refuse at the first sync, refused here (`sync/gpu.py`)."""
    r, nodes = cfg.rollout, cfg.parallelism.nodes
    if r.weight_transfer == "ipc" and r.placement != "colocated":
        return [Finding("error", "weight-transfer", "rollout.weight_transfer",
                        "'ipc' shares GPU memory on the trainer's node: it needs placement 'colocated' "
                        "(use 'nccl' or 'shm' for rollout nodes)")]
    if r.weight_transfer == "ipc" and nodes > 1:
        return [Finding("error", "weight-transfer", "rollout.weight_transfer",
                        f"'ipc' reaches only the GPUs of trainer rank 0's node, but the colocated servers run on "
                        f"all {nodes} trainer nodes (parallelism.nodes); use 'shm' (or parallelism.nodes: 1)")]
    shared = duplicate_gpus(nccl_weight_group(cfg)) if r.weight_transfer == "nccl" else []
    if shared:
        first = shared[0]
        return [Finding("error", "weight-transfer", "rollout.weight_transfer",
                        f"'nccl' puts {' and '.join(m.role for m in first)}, all on GPU {first[0].gpu} of node "
                        f"{first[0].node}, into one NCCL group, which NCCL refuses (duplicate GPU; {len(shared)} "
                        "GPU(s) shared); use 'shm' or 'ipc' for colocated servers, 'nccl' with placement "
                        "'disaggregated'")]
    return []


def nccl_patches_in_place(r: RolloutConfig) -> bool:
    """Whether this rollout's servers may take `sparse_nccl` delta rounds, patched in place
    (`rollout/engines/gpu.py`): weight transfer `nccl`, `sync_delta` not 'off', no level-2 sleep.
    Their launch then asks for vLLM's Triton MoE kernels (`RolloutServer.command`)."""
    return r.weight_transfer == "nccl" and r.sync_delta != "off" and r.sleep_level != 2


def delta_sync_where(cfg: RecipeConfig) -> str | None:
    """Why this recipe's syncs cannot be deltas (`sync/delta.py`), or None: they can (weight
    transfer `nccl`, in vLLM's sparse_nccl format; `shm` to servers on the trainer's one node, or
    on rollout nodes that keep their copy in their /dev/shm, `topology.weight_copy_path`)."""
    r = cfg.rollout
    if r.weight_transfer == "ipc":
        return "weight_transfer 'ipc' sends every version whole"
    if r.weight_transfer == "nccl":
        return "a level-2 sleep drops the servers' weights, which every sync then refills whole" \
            if r.sleep_level == 2 else None
    if r.placement == "disaggregated" and weight_copy_path(cfg).kind == "shared_run_dir":
        return "servers on rollout nodes read a new directory of the shared run dir every update"
    if r.placement == "colocated" and cfg.parallelism.nodes > 1:
        return "a sender per node (colocated over several nodes) sends every version whole"
    if r.sleep_level == 2:
        return "a level-2 sleep drops the servers' weights, which every sync then refills whole"
    return None


@rule("sync-delta")
def _sync_delta(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    """`rollout.sync_delta: on` where the transport sends every version whole, refused before the
    run (the transport refuses it at start-up too)."""
    why = delta_sync_where(cfg)
    if cfg.rollout.sync_delta == "on" and why is not None:
        return [Finding("error", "sync-delta", "rollout.sync_delta",
                        f"'on' is not supported here: {why}; use 'auto' (whole syncs here) or 'off'")]
    return []


@rule("rollout-server-fits-a-node")
def _server_per_node(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    # vLLM is started once per node (the sbatch script's rollout step, or each trainer node's first
    # rank): nothing launches one server across nodes. A CPU job (no GPUs) has nothing to count.
    r, gpus = cfg.rollout, cfg.gpus_per_node
    size = r.tensor_parallel_size * r.data_parallel_size
    if gpus and size > gpus:
        return [Finding("error", "rollout-server-fits-a-node", "rollout.data_parallel_size",
                        f"one vLLM server of rollout.tensor_parallel_size {r.tensor_parallel_size} × "
                        f"rollout.data_parallel_size {r.data_parallel_size} = {size} GPUs does not fit a node of "
                        f"{gpus} GPUs (slurm.gpus_per_node, else parallelism.gpus_per_node); servers run one per "
                        f"node ({r.placement}), so TP × DP must be <= {gpus}")]
    if gpus and r.placement == "disaggregated" and size < gpus:
        return [Finding("warning", "rollout-server-fits-a-node", "rollout.data_parallel_size",
                        f"each rollout node starts one server of TP × DP = {size} GPUs; {gpus - size} of its "
                        f"{gpus} GPUs stay idle (make TP × DP = parallelism.gpus_per_node)")]
    return []


@rule("sleep-needs-colocation")
def _sleep(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    r = cfg.rollout
    if r.sleep_level is not None and r.placement == "disaggregated":
        return [Finding("warning", "sleep-needs-colocation", "rollout.sleep_level",
                        f"{r.sleep_level}: the servers have nodes of their own, so sleeping frees no memory "
                        "the trainer could use and costs a wake-up every step (set it to null)")]
    return []


@rule("async-rollout")
def _async_rollout(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    # The servers generate while the trainer computes: on shared GPUs (colocated) both would fight
    # for the same memory and SMs, and a sleeping server cannot generate ahead (`train/ahead.py`).
    r = cfg.rollout
    if not r.max_staleness:
        return []
    if r.placement != "disaggregated":
        return [Finding("error", "async-rollout", "rollout.max_staleness",
                        f"{r.max_staleness} makes the servers generate while the trainer trains, but placement is "
                        f"'{r.placement}': colocated servers share the trainer's GPUs; use placement "
                        "'disaggregated' (with rollout.nodes) or max_staleness 0")]
    if r.sleep_level is not None:
        return [Finding("error", "async-rollout", "rollout.sleep_level",
                        f"{r.sleep_level}: a sleeping server cannot generate the next steps while the trainer "
                        f"trains (rollout.max_staleness {r.max_staleness}); set sleep_level to null")]
    # The default 'auto' is tis_token here, so a 'none' was written by someone: it runs, warned.
    if cfg.correction_mode == "none":
        return [Finding("warning", "async-rollout", "algorithm.correction.mode",
                        f"'none' with rollout.max_staleness {r.max_staleness}: samples come from weights up to "
                        f"{r.max_staleness} version(s) older than π_old, and nothing corrects for it; the tiny "
                        "async GRPO collapsed in 4 steps so (leave it 'auto' = 'tis_token', or 'mask_token')")]
    return []


@rule("correction-at-raw-logprobs")
def _correction_raw(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    r = cfg.rollout
    if cfg.correction_mode != "none" and r.logprobs_mode == "raw" and r.temperature != 1.0:
        return [Finding("warning", "correction-at-raw-logprobs", "rollout.logprobs_mode",
                        f"the mismatch correction weighs by π_old / π_rollout, and with logprobs_mode raw both are at "
                        f"T = 1 while sampling was at T = {r.temperature:g}: the weights correct the version and "
                        "engine gap only, not toward the distribution sampled from; logprobs_mode processed makes "
                        "them the behaviour policy's")]
    return []


@rule("lora-sleep")
def _lora_sleep(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    # Level 2 drops the server's weights; a LoRA sync after the wake sends only the adapted tensors
    # (`sync/lora.py::sync_actor`), so every other tensor of the server would be whatever memory it got back.
    if cfg.lora.rank > 0 and cfg.rollout.sleep_level == 2:
        return [Finding("error", "lora-sleep", "rollout.sleep_level",
                        "2 drops the servers' weights, and a LoRA/QLoRA sync refills only the adapted tensors: "
                        "the base would be garbage after the wake; use sleep_level 1 (weights offloaded to "
                        "host memory, brought back at the wake) or null")]
    return []


@rule("routing-replay")
def _routing_replay(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    r, out = cfg.rollout, []
    if r.routing_replay and hf is not None and not num_experts(hf):
        out.append(Finding("error", "routing-replay", "rollout.routing_replay",
                           "routing replay needs a MoE model; this model has no experts"))
    if r.routing_replay_diagnostics and not r.routing_replay:
        out.append(Finding("error", "routing-replay", "rollout.routing_replay_diagnostics",
                           "the diagnostics compare against replayed routes: set rollout.routing_replay: true"))
    return out


@rule("lora-targets")
def _lora(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    """LoRA settings act only with a rank; each target must exist in the model and have an
    adapter code path (attention q/k/v/o, experts at expert-TP 1)."""
    lo, out = cfg.lora, []
    defaults = type(lo)()
    if lo.rank == 0:
        changed = [k for k in ("alpha", "targets", "dropout") if getattr(lo, k) != getattr(defaults, k)]
        if changed:
            out.append(Finding("warning", "lora-targets", f"lora.{changed[0]}",
                               f"lora.{', lora.'.join(changed)} set but lora.rank is 0: the full model trains"))
        return out
    if not lo.targets:
        out.append(Finding("error", "lora-targets", "lora.targets", "lora.rank is set but lora.targets is empty"))
    has = {"gdn": hf is not None and "linear_num_key_heads" in hf, "experts": hf is not None and num_experts(hf) > 0}
    for target in sorted(set(lo.targets) & set(has)):
        if hf is not None and not has[target]:
            out.append(Finding("error", "lora-targets", "lora.targets",
                               f"target {target!r}: the model ({hf.get('architectures')}) has no "
                               f"{'Gated DeltaNet layers' if target == 'gdn' else 'experts'}"))
        elif target == "gdn":
            out.append(Finding("error", "lora-targets", "lora.targets",
                               "target 'gdn' has no adapter code path yet; use q, k, v, o, experts"))
    p = cfg.parallelism
    if "experts" in lo.targets and p.expert_tp > 1:
        out.append(Finding("error", "lora-targets", "parallelism.expert_tensor_parallel_size",
                           "lora.targets 'experts' needs expert_tensor_parallel_size 1 (it defaults to the TP size)"))
    gpu_experts = "experts" in lo.targets and cfg.gpus_per_node and lo.base_quantization == "none"
    if gpu_experts and hf is None:
        # Without the model's config this cannot tell a MoE model (refused below) from a dense one
        # (refused above, once the config reads): say that, not a claim about the model.
        out.append(Finding("warning", "lora-targets", "model.hf_config",
                           f"'experts' on a GPU job not checked: {_no_hf_config(cfg)}"))
    elif gpu_experts and hf is not None and num_experts(hf):
        # The GPU build groups a layer's experts into TE's grouped GEMM (`megatron/gpt.py::moe_config`),
        # which has no per-expert linears to hook (`megatron/lora.py` raises after the model build).
        # QLoRA's spec (`megatron/qlora_spec.py`) runs them as SequentialMLP over local linears.
        out.append(Finding("error", "lora-targets", "lora.targets",
                           "'experts' on a GPU job: the GPU build runs the experts as Transformer Engine's grouped "
                           "GEMM, which has no per-expert linears for adapters; use q, k, v, o, or QLoRA "
                           "(lora.base_quantization: nf4, whose spec has per-expert linears), or a CPU job "
                           "(slurm.gpus_per_node 0)"))
    return out


def _no_hf_config(cfg: RecipeConfig) -> str:
    """Why a rule has no HF config to read (`lint` passes None): the recipe names none, or the
    file is missing or unreadable here (the error says which file and why)."""
    if not cfg.model.hf_config:
        return "the recipe names no model.hf_config"
    try:
        read_hf_config(cfg.model.hf_config)
    except ModelConfigError as exc:
        return f"the model's HF config cannot be read ({exc})"
    return f"the model's HF config {cfg.model.hf_config} was not read"


@rule("thinking-budget")
def _thinking_budget(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    """A template that starts the answer in a thinking block needs room to close it."""
    from ..data.thinking import MIN_THINKING_BUDGET, THINKING_MODES, thinking_mode

    r, m = cfg.rollout, cfg.model
    if r.max_response_length >= MIN_THINKING_BUDGET:
        return []
    where = m.tokenizer or m.init_checkpoint
    mode, how = thinking_mode(where, r.chat_template_kwargs)
    if mode not in THINKING_MODES:
        return []
    opener = "the prompt opens <think>" if mode == "opens" else \
        "the model opens <think> itself (enable_thinking is not false)"
    return [Finding("warning", "thinking-budget", "rollout.max_response_length",
                    f"{r.max_response_length} tokens, but the chat template of {where} starts every answer in a "
                    f"thinking block (judged by {how}: {opener}); under {MIN_THINKING_BUDGET} tokens most "
                    "completions end inside it, before any answer. Use a non-thinking checkpoint (Instruct-2507), "
                    "set rollout.chat_template_kwargs: {enable_thinking: false}, or raise max_response_length")]


@rule("reward-names")
def _rewards(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    """The task and every reward load (a plugin's import runs here, before any model starts)."""
    from ..tasks import plugin_problems

    return [Finding("error", "reward-names", key, message)
            for key, message in plugin_problems(cfg.task, cfg.rewards.weights)]


@rule("lora-base-quantization")
def _lora_quantization(cfg: RecipeConfig, hf: HF) -> list[Finding]:
    lora = cfg.lora
    if lora.base_quantization == "none":
        return []
    if lora.rank == 0:
        return [Finding("error", "lora-base-quantization", "lora.base_quantization",
                        f"{lora.base_quantization!r} quantizes the frozen base of LoRA: set lora.rank > 0, "
                        "or base_quantization: none (a fully trained model cannot have a quantized base)")]
    if lora.base_quantization == "fp8":
        return [Finding("error", "lora-base-quantization", "lora.base_quantization",
                        "'fp8' has no code path yet; allowed: nf4, none")]
    # GPU jobs too: the actor builds the QLoRA spec (`megatron/qlora_spec.py`), never the TE spec
    # whose linears cannot hold an NF4 base. Every registered architecture has one, of local
    # linears only (tests/unit/test_qlora_spec.py; an architecture without one is refused when the
    # model is built), with TENorm under sequence parallelism — the project's RMSNorm without TE,
    # never megatron's WrappedTorchNorm, which refuses SP: so SP needs no rule here.
    return []


def missing_paths(cfg: Any, prefix: str = "") -> list[Finding]:
    """Every path-typed field (schema `spec(path=True)`) that is set but does not exist."""
    out: list[Finding] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out += missing_paths(value, key + ".")
        elif f.metadata.get("path") and isinstance(value, str) and not Path(value).exists():
            out.append(Finding("error", "missing-file", key, f"no such file or directory: {value}"))
    return out


def lint(cfg: RecipeConfig, check_paths: bool = True) -> list[Finding]:
    """Run every rule. A model config that cannot be read is itself a finding.

    `check_paths=False` skips existence checks, for recipes whose paths live on a cluster.
    """
    findings: list[Finding] = missing_paths(cfg) if check_paths else []
    try:
        hf = resolve_hf_config(cfg.model) if check_paths or not cfg.model.hf_config or \
            Path(cfg.model.hf_config).exists() else None
    except ModelConfigError as exc:
        findings.append(Finding("error", "model-config", "model.hf_config", str(exc)))
        hf = None
    for fn in RULES.values():
        findings.extend(fn(cfg, hf))
    return findings
