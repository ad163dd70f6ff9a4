"""Seconds of one RL step, phase by phase, from the layout, the model and a GPU type's constants
(`gpus.py`); pure Python like the rest of the planner.

The loop's phases (`train/loop.py`), in order, and how each is modelled:

* **rollout** — each vLLM server's DP replicas decode their share of the step's samples
  (`global_batch_size × steps_per_generation`, whole groups of `rollout.n`) in continuous batches,
  simulated step by step (`simulate_replica`): a replica admits samples while its KV cache (the
  budget `memory.rollout_memory` computes; the prompt's blocks shared by the n samples of a
  request, vLLM's prefix caching) and `max_num_seqs` allow, preempts the newest when the growing
  contexts overflow it (recomputed on re-admission), and frees a sample's blocks when it ends. A
  decode step is memory-bound (every weight on the GPU, the experts a step's tokens touch, the KV
  of every context) or compute-bound (2 · active params · tokens), whichever is longer, plus the
  host's per-step overhead and the TP/EP collectives' latencies. Prefill is compute-bound and rides
  in the step that admits it. Response lengths: one sample per replica runs to the longest
  response (the cap unless `Workload` says otherwise: the tail a step waits for), the others
  spread uniformly around the mean response;
* **sleep / wake** (`rollout.sleep_level`) — level 1 copies vLLM's weights to the host and back
  over PCIe; level 2 drops them (the sync refills them); 0 only pauses;
* **logprobs** — forward passes of π_old and, with a reference, π_ref over every row (plus one
  more with `routing_replay_diagnostics`): 2 · active params · tokens + causal attention
  (2 · s² · heads · head_dim per full-attention layer), at the training MFU, with the pipeline's
  fill and drain ((PP − 1) / micro-batches);
* **train** — `steps_per_generation` optimizer steps: 6 · active params · tokens (+2 with full
  recompute, the extra forward; 4 with LoRA: a frozen base has no weight gradients) + as many
  forward attentions, over world × peak × MFU, the pipeline bubble; the distributed optimizer's
  reduce-scatter of fp32 gradients and all-gather of bf16 weights over the data-parallel groups
  (rings: (n − 1)/n · 6 bytes per parameter of the GPU's model shard, over InfiniBand when the
  group spans nodes); CPU Adam (`optimizer_cpu_offload`): gradients down and weights up over PCIe,
  and the step itself at the node's host memory bandwidth;
* **sync** (`rollout.weight_transfer`) — global rank 0 gathers every tensor (over its NIC from
  other nodes, NVLink from its own), then `shm` copies them to host segments (PCIe) that a lone
  server on its node reads, or, colocated over several nodes, broadcasts them to a sender on every
  node (InfiniBand) that copies them into its node's segments (`sync/nodes.py`), or (servers on
  rollout nodes) streams them over its NIC to a receiver on every rollout node at once, which
  writes its node's /dev/shm copy (`sync/network.py`; without receivers: the shared run directory,
  written and read at the file system's rate); with delta sync rank 0 compares every tensor with
  its host copy and sends the changed share; `nccl` broadcasts from rank 0's GPU to every
  worker; `ipc` copies every tensor to each GPU of the servers on rank 0's node (NVLink). Each
  server's workers then load their part (PCIe for `shm`).

Gated DeltaNet layers (Qwen3-Next) count through their projections (in the active parameters);
their chunked recurrence (a few FLOPs per head × key dim × value dim per token) is left out: ~1 %
of Qwen3-Next's forward. The synchronous step is the sum of its phases. With asynchronous rollout
(`rollout.max_staleness` >= 1) the servers generate step k + 1 while the trainer computes step k's
log-probs and trains, and start on the weights of step k's sync, which waits for the batch in
flight: the step is sync + max(rollout, log-probs + train). Tokens/s/GPU counts prompt +
response tokens of every sample, over the step and every GPU of the job (trainer and rollout
nodes), as NeMo-RL's performance summary does. One MFU serves every layout: TP and EP communication are inside it, so
`plan --rank time` tells layouts apart by recompute, pipeline bubble, CPU Adam and gradient sync,
not by their collectives. Reward scoring, the sync's verification (4 probe sequences) and evaluation every
`evaluation.interval` steps are left out.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..config.rules import delta_sync_where
from ..config.schema import RecipeConfig
from ..topology import weight_copy_path
from .gpus import HOST_STEP_OVERHEAD_S, IB_LATENCY_S, NVLINK_LATENCY_S, SHARED_FS_GB_S, GpuSpec
from .host import first_sync_bytes, owner_copy_bytes, sync_bytes
from .memory import DTYPE_BYTES, GB, Hardware, RolloutMemory, dense_shards, expert_dp, seq_length
from .params import ModelParams, Shard

GOLDEN = 0.6180339887498949
ADAM_HOST_BYTES_PER_PARAM = 40
"""CPU Adam's traffic per parameter: read grad, m, v, master (16 B), write m, v, master (12 B), the
bf16 copy and the gradient's fp32 staging (~12 B)."""


@dataclass(frozen=True)
class Workload:
    """Mean token counts of one sample, and the longest response of a step."""

    prompt_tokens: float
    response_tokens: float
    longest_response: int

    @classmethod
    def of(cls, cfg: RecipeConfig, prompt: float | None = None, response: float | None = None) -> Workload:
        """Defaults: the caps (every prompt at `max_prompt_length`, every response at
        `max_response_length`): an upper bound of the step, as the memory model is one of memory."""
        r = cfg.rollout
        p = float(r.max_prompt_length if prompt is None else min(prompt, r.max_prompt_length))
        resp = float(r.max_response_length if response is None else min(response, r.max_response_length))
        return cls(p, resp, r.max_response_length)

    @property
    def sequence_tokens(self) -> float:
        return self.prompt_tokens + self.response_tokens


@dataclass(frozen=True)
class Phase:
    key: str
    label: str
    seconds: float
    note: str = ""


@dataclass(frozen=True)
class StepTime:
    gpu: str
    phases: tuple[Phase, ...]
    gpus: int
    """Every GPU of the job: trainer nodes and rollout nodes."""
    tokens: float
    """Prompt + response tokens of the step's samples."""
    modelled: tuple[str, ...] = ()
    """What of the layout the trainer or the servers would refuse, modelled anyway."""
    overlapped: bool = False
    """Asynchronous rollout: the rollout runs beside the log-probs and training (`rollout.max_staleness`)."""

    @property
    def seconds(self) -> float:
        if not self.overlapped:
            return sum(p.seconds for p in self.phases)
        beside = {"rollout", "logprobs", "train"}
        trainer = self.phase("logprobs").seconds + self.phase("train").seconds
        serial = sum(p.seconds for p in self.phases if p.key not in beside)
        return serial + max(self.phase("rollout").seconds, trainer)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / (self.seconds * self.gpus) if self.seconds > 0 else 0.0

    def phase(self, key: str) -> Phase:
        return next(p for p in self.phases if p.key == key)


# ----------------------------------------------------------------------------- rollout
@dataclass(frozen=True)
class Replica:
    """One DP replica of a vLLM server, with what a decode step costs on one of its GPUs."""

    tp: int
    dp: int
    experts_span_replicas: bool
    dense_bytes: float
    expert_bytes: float
    kv_token_bytes: float
    state_bytes: float
    capacity_tokens: float
    concurrency: int
    cross_node: bool


def replica_of(params: ModelParams, cfg: RecipeConfig, ro: RolloutMemory, g: GpuSpec, hw: Hardware) -> Replica:
    r = cfg.rollout
    per_token = max(ro.kv_token_bytes, 1e-9)
    budget = max(0.0, ro.kv_budget_gb * GB)
    concurrency = min(g.vllm_max_num_seqs, max(1, r.max_concurrency * r.n // r.data_parallel_size))
    return Replica(r.tensor_parallel_size, r.data_parallel_size, r.enable_expert_parallel,
                   (ro.weights_gb - ro.expert_weights_gb) * GB, ro.expert_weights_gb * GB, ro.kv_token_bytes,
                   ro.state_bytes, budget / per_token, concurrency,
                   r.tensor_parallel_size * r.data_parallel_size > hw.gpus_per_node)


def decode_step_fn(params: ModelParams, rep: Replica, g: GpuSpec) -> Callable[[int, float, float, float], float]:
    """Seconds of one engine step of a replica: `batch` decoding sequences whose contexts sum to
    `context`, plus `prefill` prompt tokens (Σ prompt² = `prefill_sq` for their attention)."""
    d = params.dims
    active = params.active - params.component("embedding")     # the lookup is no matmul
    full = sum(1 for layer in params.layers if layer.mixer == "full_attention")
    attn = d.heads * d.head_dim * full / rep.tp
    moe_layers = sum(1 for layer in params.layers if layer.ffn == "moe")
    pick = d.top_k / d.experts if d.experts else 0.0
    collectives = (2 * len(params.layers) if rep.tp > 1 else 0) + (2 * moe_layers if rep.experts_span_replicas
                                                                     and rep.dp > 1 else 0)
    overhead = HOST_STEP_OVERHEAD_S + collectives * (IB_LATENCY_S if rep.cross_node else NVLINK_LATENCY_S)
    gpus = rep.tp * rep.dp

    def step(batch: int, context: float, prefill: float, prefill_sq: float) -> float:
        tokens = batch + prefill
        routed = tokens * (rep.dp if rep.experts_span_replicas else 1)
        touched = 1.0 - (1.0 - pick) ** routed if pick else 1.0
        memory = (rep.dense_bytes + rep.expert_bytes * touched + rep.kv_token_bytes * context
                  + 2 * rep.state_bytes * batch)
        flops = 2 * active * tokens * rep.dp / gpus + 4 * context * attn + 2 * prefill_sq * attn
        return max(memory / (g.hbm_bytes_s * g.decode_efficiency), flops / (g.peak_flops * g.train_mfu)) + overhead

    return step


def response_lengths(count: int, mean: float, longest: int) -> list[int]:
    """One sample at `longest` (in the middle of the admission order), the others uniform around
    `mean` (as wide as the cap allows), spread by a golden-ratio sequence."""
    if count <= 1:
        return [longest] * count
    rest = max(1.0, (count * mean - longest) / (count - 1))
    lo, hi = (2 * rest - longest, float(longest)) if 2 * rest >= longest else (0.0, 2 * rest)
    out = [max(1, round(lo + (hi - lo) * ((j * GOLDEN) % 1.0))) for j in range(count - 1)]
    out.insert(count // 2, longest)
    return out


@dataclass
class _Replay:
    """The state of `simulate_replica`."""

    usage: float = 0.0
    generated: float = 0.0


def simulate_replica(lengths: list[int], prompt: float, group: int, concurrency: int, capacity: float,
                     state_tokens: float, step: Callable[[int, float, float, float], float]) -> tuple[float, int]:
    """Seconds until the last of `lengths` (samples in groups of `group` sharing a `prompt`) is
    generated, and how many preemptions it took. KV `capacity` in tokens; `state_tokens` is a
    sequence's fixed state in token equivalents."""
    queue, done = deque(range(len(lengths))), [0] * len(lengths)
    active: dict[int, tuple[int, int]] = {}          # id → (step admitted, tokens done before)
    epoch = [0] * len(lengths)
    finish: list[tuple[int, int, int]] = []          # (step it ends, id, epoch): a heap
    members: dict[int, int] = {}
    s, clock, preempted, steps = _Replay(), 0.0, 0, 0
    while queue or active:
        prefill = prefill_sq = 0.0
        while queue and len(active) < concurrency:
            i = queue[0]
            new_group = members.get(i // group, 0) == 0
            need = done[i] + state_tokens + (prompt if new_group else 0.0)
            if active and s.usage + need > capacity:
                break
            queue.popleft()
            active[i] = (steps, done[i])
            members[i // group] = members.get(i // group, 0) + 1
            s.usage += need
            s.generated += done[i]
            prefill += done[i] + (prompt if new_group else 0.0)
            prefill_sq += prompt ** 2 if new_group else 0.0
            heapq.heappush(finish, (steps + lengths[i] - done[i], i, epoch[i]))
        batch = len(active)
        clock += step(batch, batch * prompt + s.generated, prefill, prefill_sq)
        steps += 1
        s.usage += batch
        s.generated += batch
        while finish and finish[0][0] <= steps:
            _, i, e = heapq.heappop(finish)
            if e == epoch[i] and i in active:
                _leave(s, active, members, i, lengths[i], prompt, group, state_tokens)
        while s.usage > capacity and len(active) > 1:
            victim = next(reversed(active))
            start, before = active[victim]
            done[victim] = before + steps - start
            _leave(s, active, members, victim, done[victim], prompt, group, state_tokens)
            epoch[victim] += 1
            queue.appendleft(victim)
            preempted += 1
    return clock, preempted


def _leave(s: _Replay, active: dict[int, tuple[int, int]], members: dict[int, int], i: int, tokens: int,
           prompt: float, group: int, state_tokens: float) -> None:
    del active[i]
    members[i // group] -= 1
    s.usage -= tokens + state_tokens + (prompt if members[i // group] == 0 else 0.0)
    s.generated -= tokens


def rollout_engines(cfg: RecipeConfig, hw: Hardware) -> tuple[int, str]:
    """Servers generating at once, and a note when one would span nodes (modelled: our servers
    run one per node, `rollout-server-fits-a-node`)."""
    r = cfg.rollout
    nodes = cfg.parallelism.nodes if r.placement == "colocated" else r.nodes
    per = r.tensor_parallel_size * r.data_parallel_size
    if per <= hw.gpus_per_node:
        return max(1, nodes), ""
    return max(1, nodes * hw.gpus_per_node // per), (f"vLLM engines of TP {r.tensor_parallel_size} × DP "
                                                     f"{r.data_parallel_size} span nodes (ours run one per node)")


def rollout_seconds(params: ModelParams, cfg: RecipeConfig, ro: RolloutMemory, wl: Workload, g: GpuSpec,
                    hw: Hardware) -> tuple[Phase, str]:
    r, a = cfg.rollout, cfg.algorithm
    engines, note = rollout_engines(cfg, hw)
    rep = replica_of(params, cfg, ro, g, hw)
    prompts = cfg.trainer.global_batch_size * a.steps_per_generation // r.n
    groups = max(1, math.ceil(prompts / (engines * rep.dp)))
    lengths = response_lengths(groups * r.n, wl.response_tokens, wl.longest_response)
    state_tokens = rep.state_bytes / rep.kv_token_bytes if rep.kv_token_bytes else 0.0
    seconds, preempted = simulate_replica(lengths, wl.prompt_tokens, r.n, rep.concurrency, rep.capacity_tokens,
                                          state_tokens, decode_step_fn(params, rep, g))
    words = (f"{engines} server(s) × {rep.dp} replica(s), {groups * r.n} samples per replica, up to "
             f"{rep.concurrency} at once, KV {rep.capacity_tokens / 1e3:.0f}k tokens; longest "
             f"{wl.longest_response} tokens" + (f"; {preempted} preemptions" if preempted else ""))
    return Phase("rollout", "rollout (prefill + decode, longest sample)", seconds, words), note


# ----------------------------------------------------------------------------- trainer
def _forward_flops(params: ModelParams, rows: float, seq: float) -> float:
    d = params.dims
    full = sum(1 for layer in params.layers if layer.mixer == "full_attention")
    matmul = params.active - params.component("embedding")
    return rows * (2 * matmul * seq + 2 * seq * seq * d.heads * d.head_dim * full)


def _microbatches(cfg: RecipeConfig, rows: float, seq: float) -> float:
    t = cfg.trainer
    per_rank = rows / cfg.parallelism.data_parallel_size
    if t.max_tokens_per_microbatch is not None:
        return max(1.0, math.ceil(per_rank * seq / max(t.max_tokens_per_microbatch, seq)))
    return max(1.0, per_rank / t.micro_batch_size)


def _bubble(cfg: RecipeConfig, microbatches: float) -> float:
    pp, vpp = cfg.parallelism.pipeline_model_parallel_size, cfg.parallelism.virtual_pipeline_model_parallel_size
    return (pp - 1) / (microbatches * (vpp or 1)) if pp > 1 else 0.0


def _computed_tokens(cfg: RecipeConfig, wl: Workload) -> float:
    """Tokens a row costs the trainer: its own with a token budget (rows cut to their longest),
    the padded `seq_length` without."""
    return wl.sequence_tokens if cfg.trainer.max_tokens_per_microbatch is not None else float(seq_length(cfg))


def _compute_seconds(flops: float, cfg: RecipeConfig, rows: float, seq: float, g: GpuSpec) -> float:
    """`flops` over every trainer GPU at the training MFU, plus the pipeline's fill and drain."""
    world = cfg.parallelism.world_size
    return flops / (world * g.peak_flops * g.train_mfu) * (1 + _bubble(cfg, _microbatches(cfg, rows, seq)))


def logprob_seconds(params: ModelParams, cfg: RecipeConfig, wl: Workload, g: GpuSpec) -> Phase:
    rows = cfg.trainer.global_batch_size * cfg.algorithm.steps_per_generation
    seq = _computed_tokens(cfg, wl)
    # π_ref exists when the KL term does (the trainer's rule); with LoRA it is the base, one more forward.
    passes = 1 + int(cfg.algorithm.uses_reference) + int(cfg.rollout.routing_replay and
                                                       cfg.rollout.routing_replay_diagnostics)
    flops = passes * _forward_flops(params, rows, seq)
    seconds = _compute_seconds(flops, cfg, rows, seq, g)
    names = "π_old" + (", π_ref" if passes > 1 else "") + (", no-replay" if passes > 2 else "")
    return Phase("logprobs", "log-probs (forward)", seconds, f"{names} over {rows} rows × {seq:.0f} tokens")


def train_seconds(params: ModelParams, cfg: RecipeConfig, wl: Workload, g: GpuSpec, hw: Hardware) -> Phase:
    spg, rows = cfg.algorithm.steps_per_generation, cfg.trainer.global_batch_size
    seq = _computed_tokens(cfg, wl)
    recompute = cfg.parallelism.recompute_granularity == "full"
    forward = _forward_flops(params, rows, seq)
    if cfg.algorithm.name == "chord":
        forward += _forward_flops(params, cfg.algorithm.chord.sft_batch_size, seq)
    # A forward, the backward's activation gradients (one more) and, unless LoRA freezes the base,
    # its weight gradients (one more); full recompute repeats the forward.
    passes = (2 if cfg.lora.rank else 3) + int(recompute)
    flops = forward * passes
    compute = _compute_seconds(flops, cfg, rows, seq, g)
    optimizer = optimizer_seconds(params, cfg, g, hw)
    note = (f"{spg} × ({rows} rows × {seq:.0f} tokens, {passes} passes, "
            f"{compute:.1f} s + optimizer {optimizer:.1f} s)")
    return Phase("train", "train (forward, backward, optimizer)", spg * (compute + optimizer), note)


def optimizer_seconds(params: ModelParams, cfg: RecipeConfig, g: GpuSpec, hw: Hardware) -> float:
    """One optimizer step: data-parallel gradient reduce-scatter (fp32) and weight all-gather (bf16),
    then Adam (on the GPU: negligible; on the host: PCIe both ways and host memory bandwidth)."""
    if cfg.lora.rank:
        return 0.0               # adapters: MBs
    p = cfg.parallelism
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dense = sum(b.params for b in params.blocks() if b.shard is not Shard.EXPERT) / (tp * pp)
    expert = sum(b.params for b in params.blocks() if b.shard is Shard.EXPERT) / (p.expert_model_parallel_size
                                                                                   * p.expert_tp * pp)
    link = (g.ib_gb_s if p.world_size > hw.gpus_per_node else g.nvlink_gb_s) * 1e9
    seconds = 0.0
    for count, group in ((dense, dense_shards(p)), (expert, expert_dp(p))):
        if group > 1:
            seconds += (group - 1) / group * count * (4 + 2) / link
    shard = dense / dense_shards(p) + expert / expert_dp(p)
    if p.optimizer_cpu_offload:
        seconds += shard * (4 + 2) / (g.pcie_gb_s * 1e9)
        seconds += shard * ADAM_HOST_BYTES_PER_PARAM * hw.gpus_per_node / (g.host_memory_bw_gb_s * 1e9)
    return seconds


# ----------------------------------------------------------------------------- sync, sleep
DELTA_CHANGED_FRAC = 0.045
"""Share of a tensor's elements a step changes: the published 4.5 % for Qwen3-30B-A3B bf16 at lr 1e-6
(1.98 % for a 1T FP8 model); no `bench/sync_bench.py --delta` measurement of a production model is
in the repo. A patch element costs 3 × a bf16 element (value + int32 index, `sync/delta.py`)."""
DELTA_PATCH_COST = 3.0


def sync_seconds(params: ModelParams, cfg: RecipeConfig, ro: RolloutMemory, g: GpuSpec, hw: Hardware,
                 changed: float = DELTA_CHANGED_FRAC) -> Phase:
    """A step's sync, at `changed` (the share of elements a step changes, printed in the note);
    QLoRA's first sync, which sends the whole dequantized base (`host.first_sync_bytes`), is in the
    note (once per run, not per step)."""
    nbytes, first = sync_bytes(params, cfg), first_sync_bytes(params, cfg)
    share = delta_share(cfg, changed)
    gather, send, how = _sync_parts(nbytes, params, cfg, ro, g, share)
    why = delta_sync_where(cfg) or ("rollout.sync_delta: off" if cfg.rollout.sync_delta == "off" else None)
    if share < 1.0:       # delta: whole rounds every sync_dense_every, patches between
        how += (f" (delta: {changed:.1%} of elements changed, assumed; "
                f"{share:.1%} of the bytes per sync, a dense one every {cfg.rollout.sync_dense_every})")
    else:
        would = _delta_mean(cfg.rollout.sync_dense_every, changed)
        how += (f" (dense: {why or 'past the break-even'}; with {changed:.1%} of elements changed, assumed, "
                f"a delta would send {would:.1%} of the bytes)")
    note = f"{nbytes / GB:.1f} GB: gather {gather:.1f} s, {how} {send:.1f} s"
    if first != nbytes:
        seconds = sum(_sync_parts(first, params, cfg, ro, g, 1.0)[:2])
        note += f"; the first sync sends the whole base: {first / GB:.1f} GB, {seconds:.0f} s"
    return Phase("sync", "weight sync (gather to rank 0 + send + load)", gather + send, note)


def delta_share(cfg: RecipeConfig, changed: float = DELTA_CHANGED_FRAC) -> float:
    """Mean share of a whole sync's bytes that the transport sends per step: 1 where the product
    sends every version whole (`config.rules.delta_sync_where`, `rollout.sync_delta: off`), else
    the patches, with one whole sync every `rollout.sync_dense_every`."""
    r = cfg.rollout
    if r.sync_delta == "off" or delta_sync_where(cfg) is not None:
        return 1.0
    return _delta_mean(r.sync_dense_every, changed)


def _delta_mean(dense_every: int, changed: float) -> float:
    """Mean share of the bytes of delta syncs with a whole one every `dense_every`."""
    patch = min(1.0, DELTA_PATCH_COST * changed)
    return (1.0 + (dense_every - 1) * patch) / dense_every


def _sync_parts(nbytes: float, params: ModelParams, cfg: RecipeConfig, ro: RolloutMemory,
                g: GpuSpec, share: float = 1.0) -> tuple[float, float, str]:
    """(gather seconds, send + load seconds, how) of a sync of `nbytes`, of which `share` goes to
    the servers (delta): what the comparison needs whole (the copy of every tensor to rank 0's host,
    `sync/delta.py`) is not scaled. Every transport the product runs gathers to rank 0 first
    (`send_plan.transport_plan`; only nccl_m2n would not, and no production layout fits it). Every
    server loads at once (`routes.on_every_server`), so a server's load is one GPU's part, not the
    sum over servers."""
    nodes = cfg.parallelism.nodes
    r = cfg.rollout
    gather = nbytes * (1 - 1 / nodes) / (g.ib_gb_s * 1e9) + nbytes / nodes / (g.nvlink_gb_s * 1e9)
    remote = r.placement == "disaggregated" or nodes > 1
    # Each server GPU loads its part of what is sent (all of its weights, or LoRA's touched share).
    load = ro.weights_gb * GB * nbytes / (params.total * DTYPE_BYTES[r.dtype]) / (g.pcie_gb_s * 1e9) * share
    if r.weight_transfer == "nccl":
        link = (g.ib_gb_s if remote else g.nvlink_gb_s) * 1e9
        if share >= 1.0:
            return gather, nbytes / link, "one NCCL broadcast"
        return _nccl_delta_parts(nbytes, gather, params, cfg, g, share, link)
    if r.weight_transfer == "ipc":
        return gather, nbytes * r.tensor_parallel_size * r.data_parallel_size / (g.nvlink_gb_s * 1e9), "CUDA IPC copies"
    host_copy = nbytes / (g.pcie_gb_s * 1e9)         # into the segments (and, delta, the comparison)
    if r.placement == "colocated" and nodes > 1:           # a sender per node, into its /dev/shm
        return gather, nbytes * share / (g.ib_gb_s * 1e9) + host_copy + load, "broadcast to a /dev/shm copy per node"
    if remote and weight_copy_path(cfg).kind == "network":
        return _network_parts(nbytes, gather, load / share, params, cfg, g, share)
    if remote:            # servers on rollout nodes without receivers: the shared run directory
        fs = SHARED_FS_GB_S * 1e9
        return gather, host_copy + 2 * nbytes * share / fs + load, "segments in the shared run dir"
    return gather, host_copy + load, "/dev/shm segments"


def _network_parts(nbytes: float, gather: float, load: float, params: ModelParams, cfg: RecipeConfig,
                   g: GpuSpec, share: float) -> tuple[float, float, str]:
    """`_sync_parts` of servers on rollout nodes with receivers (`sync/network.py`): per round, each
    owner copies its part to its host (all at once, the largest part last: keep or compare,
    `sync/owners.py`, `host.owner_copy_bytes`), rank 0 streams the round once over its NIC to
    every receiver at once, each writes its node's /dev/shm copy (at the PCIe rate,
    `gpus.SHARED_FS_GB_S`' note), then the servers load (`load`:
    a whole version's). A whole round gathers every tensor to rank 0 first; a delta round only the
    owners' patches (onto rank 0's host). `share`: the mean share of the bytes sent (delta), from
    whole rounds every `rollout.sync_dense_every` and patches of `patch` of the bytes between."""
    ib, pcie = g.ib_gb_s * 1e9, g.pcie_gb_s * 1e9
    copies = owner_copy_bytes(params, cfg)
    owners = len(copies)
    own = nbytes * max(copies.values()) / sum(copies.values()) / pcie      # the largest owner's part
    whole = own + nbytes / ib + nbytes / pcie + load
    how = f"over the network into each rollout node's /dev/shm ({owners} owners copy their parts)"
    if share >= 1.0:
        return gather, whole, how
    every = cfg.rollout.sync_dense_every
    patch = (share * every - 1) / (every - 1)           # the delta rounds' share (`_delta_mean`)
    sent = nbytes * patch
    patches = sent * (1 - 1 / cfg.parallelism.nodes) / ib + sent / pcie
    delta = own + sent / ib + sent / pcie + load * patch
    return (gather + (every - 1) * patches) / every, (whole + (every - 1) * delta) / every, how


def _patch_apply_seconds(nbytes: float, cfg: RecipeConfig, g: GpuSpec) -> float:
    """A delta round's apply on the servers (vLLM's patch loader, `checkpoint_weight_patch.py`),
    every worker at once: each patched checkpoint tensor staged whole in HBM (NaN where unchanged:
    one write of the unsharded bytes, on every worker), then masked into the worker's shard
    (`torch.where`: two reads and a write of the shard). Every tensor has some change at RL rates."""
    return (nbytes + 3 * nbytes / cfg.rollout.tensor_parallel_size) / g.hbm_bytes_s


def _nccl_delta_parts(nbytes: float, gather: float, params: ModelParams, cfg: RecipeConfig, g: GpuSpec,
                      share: float, link: float) -> tuple[float, float, str]:
    """`_sync_parts` of `nccl` with delta (`sync/gpu.NcclTransport`): per round each owner copies
    its part to its host (all at once, the largest last: keep or compare, `sync/owners.py`); a
    whole round gathers every tensor to rank 0 and broadcasts it, a delta round gathers only the
    owners' patches (onto rank 0's GPU) and broadcasts them in vLLM's sparse_nccl format, which
    the servers apply in place (no layer-wise reload; the whole broadcast's load is not counted
    either, as without delta), which costs each worker `_patch_apply_seconds`."""
    ib, pcie, nvlink = g.ib_gb_s * 1e9, g.pcie_gb_s * 1e9, g.nvlink_gb_s * 1e9
    copies = owner_copy_bytes(params, cfg)
    own = nbytes * max(copies.values()) / sum(copies.values()) / pcie      # the largest owner's part
    every, nodes = cfg.rollout.sync_dense_every, cfg.parallelism.nodes
    patch = (share * every - 1) / (every - 1)           # the delta rounds' share (`_delta_mean`)
    sent = nbytes * patch
    patches = sent * (1 - 1 / nodes) / ib + sent / nodes / nvlink + _patch_apply_seconds(nbytes, cfg, g)
    how = f"one NCCL broadcast, sparse_nccl patches between whole ones ({len(copies)} owners copy their parts)"
    return (gather + (every - 1) * patches) / every, own + (nbytes + (every - 1) * sent) / every / link, how


COLD_READ_GB_S = 2.0
"""A server node's read rate of a cold checkpoint: vLLM's safetensors loader faults the files in
through mmap, every server node at once from the same shared file system (each node reads every
file: TP shards and EP slices are cut from whole tensors). Page-fault-driven reads reach a fraction
of the 10-20 GB/s a streaming client gets (`SHARED_FS_GB_S`); a guess, on the low side."""
ENGINE_START_S = 300.0
"""A cold vLLM engine's start besides the read: worker processes, NCCL, torch.compile of the model
graph without a compile cache, the KV-cache memory profile and CUDA-graph capture (vLLM's default
batch sizes) on every worker. Minutes for a 48-94-layer MoE; a guess."""
STARTUP_MARGIN = 2.0
"""`rollout.startup_timeout_s` must be at least this many cold starts: both terms are guesses."""


def cold_start_seconds(params: ModelParams, cfg: RecipeConfig) -> float:
    """A server's first start, cold page cache and compile cache: what `rollout.startup_timeout_s`
    must cover (audit 3 #4: 600 s for the 235B's 470 GB per rollout node)."""
    return params.total * DTYPE_BYTES[cfg.rollout.dtype] / (COLD_READ_GB_S * 1e9) + ENGINE_START_S


def sleep_seconds(cfg: RecipeConfig, ro: RolloutMemory, g: GpuSpec) -> Phase:
    level = cfg.rollout.sleep_level
    seconds = 2 * ro.weights_gb * GB / (g.pcie_gb_s * 1e9) if level == 1 else 0.0
    note = {None: "servers stay awake", 0: "pause only", 1: "weights to host RAM and back",
            2: "weights dropped (the sync refills them)"}[level]
    return Phase("sleep", "sleep / wake", seconds, note)


def job_gpus(cfg: RecipeConfig) -> int:
    p, r = cfg.parallelism, cfg.rollout
    return (p.nodes + (r.nodes if r.placement == "disaggregated" else 0)) * p.gpus_per_node


def step_time(params: ModelParams, cfg: RecipeConfig, ro: RolloutMemory, wl: Workload, g: GpuSpec, hw: Hardware,
              modelled: tuple[str, ...] = (), rollout: Phase | None = None) -> StepTime:
    note = rollout_engines(cfg, hw)[1]
    if rollout is None:
        rollout, note = rollout_seconds(params, cfg, ro, wl, g, hw)
    phases = (rollout, sleep_seconds(cfg, ro, g), logprob_seconds(params, cfg, wl, g),
              train_seconds(params, cfg, wl, g, hw), sync_seconds(params, cfg, ro, g, hw))
    samples = cfg.trainer.global_batch_size * cfg.algorithm.steps_per_generation
    extra = modelled + ((note,) if note else ())
    return StepTime(g.name, phases, job_gpus(cfg), samples * wl.sequence_tokens, extra,
                    overlapped=cfg.rollout.max_staleness > 0)
