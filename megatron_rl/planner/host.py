"""Host memory of every node role, and the GPU terms outside the trainer's model state.

Pure Python. A node role is what one node of the job runs: a trainer node (the trainer's ranks;
with `rollout.placement: colocated`, also its node's vLLM server: a *colocated node*) or a rollout
node (one vLLM server). Host terms are GB per node; `resident` ones are summed into the verdict
against `--host-memory-gb`, `reclaimable` ones (clean page cache) are shown but not summed: the
kernel drops them under pressure.

Trainer node, per rank × ranks per node (every rank holds the step's rollout on the host:
`train/fleet.py` broadcasts the groups to all ranks, `train/batch.py` pads them):

* rollout batch tensors — `TrainBatch` at the padded `seq_len` width: tokens int64 (8 B), mask,
  rollout / π_old / π_ref log-probs fp32 (4 B each per target position), advantages — measured
  against a real `build_batch` in tests/unit/test_planner_host.py;
* rollout samples — the groups as Python objects: token lists (an 8-byte pointer + a 28-byte int
  object per token; ids < 257 are shared; a prompt's list once per group), the response log-probs
  (8 + 24 B per float); measured with tracemalloc in the same test;
* routing-replay routes (`rollout.routing_replay`, `route_host_bytes`; rank 0's node) — layers ×
  top-k ids per token, uint8 up to 256 experts else 2 bytes: every sample's compact array on global
  rank 0 (which received them), a data-parallel replica's share of the rows on each other rank
  (`megatron/route_delivery.py`), plus on every rank one micro-batch expanded to its dense width
  with a 1-byte valid flag per token (`route_rows.py`); measured in the same test;
* CPU Adam (`optimizer_cpu_offload`) — the offloaded states and master weights
  (`memory.stage_memory`'s host share) plus an fp32 staging copy of the shard's gradients (4 B per
  parameter; megatron-core HybridDeviceOptimizer);
* process baseline — PROCESS_GB per rank: Python, torch, transformers and megatron-core take
  0.4 GB of RSS after import (measured on CPU); CUDA's libraries and context, Transformer Engine
  and NCCL's pinned host buffers add a few GB per GPU process (an estimate, not derived);
* weight-sync segments (`weight_transfer: shm`, each writing node: `topology.shm_senders`) — one
  copy of the synced weights in the rollout dtype: in /dev/shm (tmpfs = RAM) for a lone server on
  rank 0's node, and on every node when colocated over several (a sender per node), else (servers
  on rollout nodes) files in the shared run directory whose written pages stay in rank 0's page
  cache (reclaimable once flushed); the largest sync counts, which with QLoRA is the first (every
  tensor, `first_sync_bytes`);
* checkpoint page cache (start-up, reclaimable) — safetensors memory-maps the HF shards; the pages
  the node's ranks read stay cached: the node's share of the checkpoint (dense weights read by
  every rank that holds them; experts by their EP rank). `megatron-rl convert` (a separate CPU
  job on one node) reads the whole checkpoint the same way: all of its bytes in the page cache,
  one layer per worker resident (`convert/worker.py` closes the reader per layer).

vLLM server (colocated or rollout node): VLLM_PROCESS_GB for the API server and engine core plus
per GPU worker; with `sleep_level: 1`, the server's weights offloaded to host RAM while it sleeps
(vLLM's CuMemAllocator backs them up in pinned CPU memory).

GPU terms outside the model state (added to the trainer's worst stage, `gpu_extra_terms`):

* weight-sync gather (global rank 0) — the largest part rank 0 holds at once: the larger of
  `sharding.GATHER_CHUNK_BYTES` and the largest unsharded tensor, twice (received, and its HF copy
  or dtype cast), plus the `nccl` transport's packed broadcast buffers (2 × 1 GiB, vLLM's default);
* weight-sync bucket (`nccl`, `ipc`; `shm` with a sender per node) — the gathered parts the GPU
  transports hold until a bucket is full (`topology.transport_bucket_bytes`: `rollout.sync_bucket_mb`,
  capped for `ipc`), on rank 0's GPU; `ipc` also copies each bucket to every server GPU of that
  node (rank 0's allocator keeps the blocks), so every GPU of stage 0 on rank 0's node holds one;
  a `shm` sender per node packs the broadcast into one bucket of `rollout.sync_bucket_mb`;
* routing-replay routes (`rollout.routing_replay`) — each in-flight micro-batch's ids on the device
  as int64 (the index dtype of the router's gather);
* gathered log-probs (last stage) — every row's log-probs, fp32, gathered over DP
  (`Actor._gather_dp`).

Not GPU terms, and why: vLLM's sleep levels free its weights (1, 2) and KV cache while the trainer
runs, but the trainer never returns its cached blocks (no `torch.cuda.empty_cache`), so both still
share every card when vLLM wakes and the colocated sum stands (sleep costs time and, at level 1,
host RAM: both counted); vLLM's CUDA graphs are inside `memory.VLLM_RUNTIME_GB`; the trainer
captures none.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.rules import delta_sync_where
from ..config.schema import ParallelismConfig, RecipeConfig
from ..send_plan import parts
from ..topology import recipe_shm_senders, transport_bucket_bytes, weight_copy_path
from .memory import (
    DTYPE_BYTES,
    GB,
    Hardware,
    RolloutMemory,
    StageMemory,
    Term,
    microbatch_tokens,
    param_bytes,
    seq_length,
)
from .params import ModelParams, Shard

PROCESS_GB = 4.0
VLLM_PROCESS_GB = 3.0
GATHER_CHUNK_BYTES = 32 << 20
"""= megatron_rl.weights.sharding.GATHER_CHUNK_BYTES (checked in tests; not imported: torch)."""
NCCL_PACKED_BYTES = 2 * (1 << 30)
"""= rollout.nccl_sender.PACKED_BUFFERS × PACKED_BUFFER_BYTES."""
INT_OBJECT_BYTES = 28 + 8
FLOAT_OBJECT_BYTES = 24 + 8


@dataclass(frozen=True)
class HostTerm:
    key: str
    label: str
    gb: float
    note: str = ""
    reclaimable: bool = False


@dataclass(frozen=True)
class NodeMemory:
    role: str
    """'trainer node', 'colocated node' (trainer + vLLM) or 'rollout node'."""
    nodes: int
    host_terms: tuple[HostTerm, ...]
    host_capacity_gb: float
    gpu_total_gb: float
    gpu_capacity_gb: float
    gpu_fits: bool

    @property
    def host_total_gb(self) -> float:
        return sum(t.gb for t in self.host_terms if not t.reclaimable)

    @property
    def host_margin_gb(self) -> float:
        return self.host_capacity_gb - self.host_total_gb

    @property
    def host_fits(self) -> bool:
        return self.host_margin_gb >= 0

    @property
    def fits(self) -> bool:
        return self.host_fits and self.gpu_fits


def route_bytes_per_token(params: ModelParams) -> int:
    d = params.dims
    return len(params.layers) * d.top_k * (1 if d.experts <= 256 else 2) if d.experts else 0


def batch_tensor_bytes(rows: int, seq_len: int, params: ModelParams, ref: bool) -> float:
    """`TrainBatch` of `rows` padded rows, after the log-prob phase (per rank), without its routes
    (`route_host_bytes`)."""
    per_position = 4 * (3 + int(ref))                      # mask, rollout, π_old (, π_ref) log-probs
    return float(rows * (8 * seq_len + per_position * (seq_len - 1) + 4))


@dataclass(frozen=True)
class RouteHostBytes:
    """Host bytes of one step's routing-replay routes on one rank."""

    dense_before: float
    """Before gpu-readiness-audit-2 #15, on every rank: the step's dense batch (rows × seq_len ×
    (ids + a valid flag)) and every sample's compact array in the broadcast groups."""
    rank0: float
    """Global rank 0: every sample's compact array, and one micro-batch expanded."""
    other: float
    """Any other rank: its replica's share of the rows (compact), and one micro-batch expanded."""


def route_host_bytes(rows: int, seq_len: int, dp: int, per_token: int, microbatch_tokens: int,
                     sample_tokens: float | None = None) -> RouteHostBytes:
    """`rows` samples of `sample_tokens` recorded tokens (default: the full `seq_len`, the upper
    bound) at `per_token` bytes of ids. A replica's share is ⌈rows / dp⌉ samples: the padded split
    gives each exactly rows / dp, the token budget balances padded tokens over ranks. The expanded
    micro-batch holds `microbatch_tokens` tokens × (ids + 1 flag); the routers' int64 copies of it
    (a few MB) are the GPU term's host twin and not counted."""
    tokens = float(seq_len if sample_tokens is None else min(sample_tokens, seq_len))
    compact = rows * tokens * per_token
    expanded = microbatch_tokens * (per_token + 1)
    return RouteHostBytes(dense_before=rows * seq_len * (per_token + 1) + compact,
                          rank0=compact + expanded, other=-(-rows // dp) * tokens * per_token + expanded)


def sample_object_bytes(rows: int, group: int, prompt: float, response: float, params: ModelParams,
                        routes: bool) -> float:
    """The rollout groups' Python lists (and numpy routes) on one rank; the n samples of a prompt
    share its token list (`rollout/client.py`; pickling keeps the sharing)."""
    out = rows / group * prompt * INT_OBJECT_BYTES + rows * response * (INT_OBJECT_BYTES + FLOAT_OBJECT_BYTES)
    if routes:
        out += rows * (prompt + response - 1) * route_bytes_per_token(params)
    return out


def checkpoint_share_bytes(params: ModelParams, p: ParallelismConfig, gpus_per_node: int, nbytes: int) -> float:
    """Bytes of the HF checkpoint one node's ranks read: each GPU reads its own shard of the dense
    tensors (TP × PP distinct shards) and of the experts (EP × ETP × PP); a node holds at most
    `gpus_per_node` distinct ones, the rest are data-parallel replicas reading the same pages."""
    dense = sum(b.params for b in params.blocks() if b.shard is not Shard.EXPERT)
    experts = sum(b.params for b in params.blocks() if b.shard is Shard.EXPERT)
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    return nbytes * (dense * min(1.0, gpus_per_node / (tp * pp))
                     + experts * min(1.0, gpus_per_node / (p.expert_model_parallel_size * p.expert_tp * pp)))


def trainer_host_terms(cfg: RecipeConfig, params: ModelParams, stage: StageMemory,
                       prompt: float, response: float, hw: Hardware) -> list[HostTerm]:
    r, ranks, seq, offload = cfg.rollout, hw.gpus_per_node, seq_length(cfg), cfg.parallelism.optimizer_cpu_offload
    rows = cfg.trainer.global_batch_size * cfg.algorithm.steps_per_generation
    tensors = batch_tensor_bytes(rows, seq, params, cfg.algorithm.uses_reference)
    # The samples' route arrays are counted with the routes (on rank 0 only).
    objects = sample_object_bytes(rows, r.n, prompt, response, params, routes=False)
    staging = 4 * stage.host_gb / 12 if offload else 0.0
    out = [HostTerm("process", "trainer processes", ranks * PROCESS_GB, f"{ranks} rank(s) × {PROCESS_GB:g} GB"),
           HostTerm("batch", "rollout batch tensors", ranks * tensors / GB, f"{rows} rows × {seq} per rank"),
           HostTerm("samples", "rollout samples (Python objects)", ranks * objects / GB,
                    f"{prompt:.0f} + {response:.0f} tokens per sample per rank")]
    if r.routing_replay and params.dims.experts > 0:
        dp, per_token = cfg.parallelism.data_parallel_size, route_bytes_per_token(params)
        b = route_host_bytes(rows, seq, dp, per_token, microbatch_tokens(cfg), prompt + response - 1)
        out.append(HostTerm("routes", "routing-replay routes (rank 0's node)", (b.rank0 + (ranks - 1) * b.other) / GB,
                            f"rank 0 all {rows} samples, others 1/{dp} of them (one replica's)"))
    out.append(HostTerm("cpu_adam", "CPU Adam states + grad staging", ranks * (stage.host_gb + staging),
                        "optimizer_cpu_offload" if offload else "optimizer on the GPU"))
    senders = recipe_shm_senders(cfg) if r.weight_transfer == "shm" else []
    sync, later = (first_sync_bytes(params, cfg) / GB, sync_bytes(params, cfg) / GB) if senders else (0.0, 0.0)
    in_ram = bool(senders) and not senders[0].shared
    where: str = ("/dev/shm (tmpfs)" if in_ram else "page cache of the shared run dir") if senders \
        else r.weight_transfer
    if senders and weight_copy_path(cfg).kind == "network":
        # Only delta syncs keep a host copy: each owner its part's (`sync/owners.py`), in its RAM.
        in_ram = delta_sync_where(cfg) is None and r.sync_delta != "off"
        node_bytes = owner_copy_bytes(params, cfg, by_node=True)
        share = max(node_bytes.values()) / (params.total * DTYPE_BYTES[r.dtype])
        sync, later = (sync * share, later * share) if in_ram else (0.0, 0.0)
        where = "RAM: the owners' copies of their parts, the largest node's (delta)" if in_ram \
            else "none: streamed to the rollout nodes' receivers"
    if r.weight_transfer == "nccl" and delta_sync_where(cfg) is None and r.sync_delta != "off":
        # The owners' host copies of their parts (`sync/owners.py`, `sync/gpu.NcclTransport`).
        in_ram = True
        share = max(owner_copy_bytes(params, cfg, by_node=True).values()) / (params.total * DTYPE_BYTES[r.dtype])
        sync, later = first_sync_bytes(params, cfg) / GB * share, sync_bytes(params, cfg) / GB * share
        where = "RAM: the owners' copies of their parts, the largest node's (nccl delta)"
    if later != sync:           # QLoRA: the first sync's segments, re-created smaller after it
        where += f"; the first sync (the whole base), then {later:.1f} GB"
    label = "weight-sync segments (every node)" if len(senders) > 1 else "weight-sync segments (rank 0's node)"
    out.append(HostTerm("sync_segments", label, sync, where, reclaimable=not in_ram))
    share = checkpoint_share_bytes(params, cfg.parallelism, ranks, DTYPE_BYTES[r.dtype])
    out.append(HostTerm("checkpoint_cache", "checkpoint page cache (start-up)", share / GB,
                        "safetensors mmap of the node's share", reclaimable=True))
    return out


def vllm_host_terms(cfg: RecipeConfig, ro: RolloutMemory, params: ModelParams | None = None) -> list[HostTerm]:
    r = cfg.rollout
    gpus = r.tensor_parallel_size * r.data_parallel_size
    out = [HostTerm("vllm_process", "vLLM processes", VLLM_PROCESS_GB * (1 + gpus),
                    f"API server + engine + {gpus} workers")]
    if params is not None and r.placement == "disaggregated" and weight_copy_path(cfg).kind == "network":
        out.append(HostTerm("node_copy", "weight copy (the receiver)", first_sync_bytes(params, cfg) / GB,
                            "/dev/shm (tmpfs): what a restarted server reloads (sync/network.py)"))
    slept = ro.weights_gb * gpus if r.sleep_level == 1 else 0.0
    out.append(HostTerm("vllm_sleep", "vLLM weights while asleep", slept,
                        "sleep_level 1: weights backed up in host RAM" if slept else f"sleep_level {r.sleep_level}"))
    return out


def owner_copy_bytes(params: ModelParams, cfg: RecipeConfig, by_node: bool = False) -> dict[int, float]:
    """Bytes of every weight in the rollout dtype, by the rank that owns it in a sync (each owner
    keeps its part for delta syncs, `sync/owners.py`), per rank or (`by_node`) per node. Owners
    are TP rank 0 (ETP rank 0 for experts) of the first replica, which unshards
    the whole tensors (`weights/sharding.gather_to_rank0`); a stage's non-expert weights are taken
    as 1/PP of them (the embedding and output layer sit on the first and last stage)."""
    p, width = cfg.parallelism, DTYPE_BYTES[cfg.rollout.dtype]
    experts = sum(b.params for b in params.blocks() if b.shard is Shard.EXPERT)
    dense = (params.total - experts) / p.pipeline_model_parallel_size
    expert = experts / (p.pipeline_model_parallel_size * p.expert_model_parallel_size)
    try:
        layout = parts(p, experts > 0)
    except ValueError:      # a layout the recipe validator refuses (a `plan --nodes` what-if): one owner
        return {0: width * params.total}
    out: dict[int, float] = {}
    for part in layout:
        if part.shard == 0 and part.kind != "replicated":   # replicated: within the dense share
            key = part.node if by_node else part.owner
            out[key] = out.get(key, 0.0) + width * (expert if part.kind == "expert" else dense)
    return out


def sync_bytes(params: ModelParams, cfg: RecipeConfig) -> float:
    """Bytes of one weight sync: every tensor, or with LoRA the merged tensors it touches."""
    nbytes = DTYPE_BYTES[cfg.rollout.dtype]
    if not cfg.lora.rank:
        return params.total * nbytes
    touched = params.component("attention") + (params.component("moe_experts") if "experts" in cfg.lora.targets else 0)
    return touched * nbytes


def first_sync_bytes(params: ModelParams, cfg: RecipeConfig) -> float:
    """Bytes of a run's first sync: `sync_bytes`, but with a quantized base (QLoRA) every tensor —
    the servers start from the original base, the trainer's is its NF4 image, so the first sync
    sends all of it dequantized (`sync/lora.py::sync_actor`): ~470 GB for Qwen3-235B."""
    if cfg.lora.rank and cfg.lora.base_quantization != "none":
        return params.total * DTYPE_BYTES[cfg.rollout.dtype]
    return sync_bytes(params, cfg)


def largest_tensor(params: ModelParams) -> float:
    """Parameters of the largest unsharded tensor (embedding/output, a fused qkv, an expert's fc1)."""
    d = params.dims
    q = d.heads * d.head_dim * (2 if params.spec.gated_attention else 1)
    return float(max(d.vocab * d.hidden, d.hidden * (q + 2 * d.kv_heads * d.head_dim), 2 * d.hidden * d.intermediate,
                     2 * d.hidden * d.moe_intermediate))


def gpu_extra_terms(cfg: RecipeConfig, params: ModelParams, stage: int, in_flight: float) -> list[Term]:
    """The terms of `stage` (its worst GPU) outside the model state (module docstring)."""
    r = cfg.rollout
    out: list[Term] = []
    if stage == 0:
        part = max(GATHER_CHUNK_BYTES, largest_tensor(params) * param_bytes(cfg)) * 2
        packed = NCCL_PACKED_BYTES if r.weight_transfer == "nccl" else 0
        out.append(Term("sync_gather", "weight-sync gather (rank 0)", (part + packed) / GB,
                        "largest part, twice" + (" + NCCL packed buffers" if packed else "")))
        per_node = r.weight_transfer == "shm" and len(recipe_shm_senders(cfg)) > 1
        if r.weight_transfer in ("nccl", "ipc") or per_node:
            # A sender per node: rank 0 packs the broadcast into one bucket (a larger tensor goes as it is).
            bucket = transport_bucket_bytes(r.weight_transfer, r.sync_bucket_mb << 20)
            where = (" on every server GPU of rank 0's node" if r.weight_transfer == "ipc"
                     else " on rank 0's GPU, broadcast to the node senders" if per_node else " on rank 0's GPU")
            out.append(Term("sync_bucket", "weight-sync bucket (GPU transports)", bucket / GB,
                            f"{bucket >> 20} MiB" + where))
    if r.routing_replay and params.dims.experts:
        moe = sum(1 for layer in params.layers if layer.ffn == "moe")
        ids = microbatch_tokens(cfg) / cfg.parallelism.context_parallel_size * moe * params.dims.top_k * 8 * in_flight
        out.append(Term("routes", "routing-replay routes (int64)", ids / GB, f"{in_flight:g} micro-batch(es)"))
    if stage == cfg.parallelism.pipeline_model_parallel_size - 1:
        rows = cfg.trainer.global_batch_size * cfg.algorithm.steps_per_generation
        out.append(Term("gathered_logprobs", "gathered log-probs (fp32)", rows * (seq_length(cfg) - 1) * 4 / GB,
                        f"{rows} rows over DP"))
    return out
