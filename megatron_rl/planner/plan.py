"""Verdict for a recipe's layout, and a search for layouts that fit.

`plan(cfg, hf, hardware)` estimates the worst GPU of the recipe's own layout (see `memory`), says
whether it fits with the margin (GB and % of the card) and names the largest term; then it
enumerates layouts — TP ∈ {1, 2, 4, 8} (≤ GPUs per node), PP dividing the layer count (≤ 16), EP
dividing the expert count, ETP ∈ {1, TP}, recompute none / full (uniform, 1 layer), optimizer on
GPU / CPU — keeps those that pass the recipe linter's own divisibility rules ('parallel-sizes',
'batch-sizes': one definition of validity) and fit with at least SAFE_MARGIN_PCT of the card to
spare (the estimate assumes balanced expert routing; a hot expert and allocator peaks eat into the
margin; with LoRA, also at start-up and at a sync: `memory.lora_peaks`), and ranks them by a cost
proxy, smallest first:

  1. optimizer on GPU before CPU offload (the offloaded Adam step is PCIe-bound, seconds per step);
  2. no recompute before full recompute (+1 forward, ~1/3 more compute);
  3. smaller TP·PP (fewer per-layer TP collectives, pipeline bubble (PP−1)/micro-batches);
  4. smaller PP (bubbles cost more than intra-node TP on NVLink);
  5. expert all-to-all within a node (EP·ETP ≤ GPUs per node) before across nodes, then smaller
     EP·ETP;
  6. larger memory margin.

Context parallelism, micro-batch size and the rollout layout are kept as the recipe sets them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..config.rules import RULES
from ..config.schema import ParallelismConfig, RecipeConfig
from .gpus import gpu
from .host import NodeMemory, gpu_extra_terms, trainer_host_terms, vllm_host_terms
from .memory import (
    Hardware,
    RolloutMemory,
    StageMemory,
    Term,
    lora_peaks,
    reserved_by_colocated_vllm,
    rollout_memory,
    worst_stage,
)
from .params import ModelParams, count_params
from .timing import Phase, StepTime, Workload, rollout_seconds, step_time

TP_CHOICES: tuple[int, ...] = (1, 2, 4, 8)
RECOMPUTE_CHOICES: tuple[Literal["none", "full"], ...] = ("none", "full")
MAX_PP = 16
SAFE_MARGIN_PCT = 10.0
LAYOUT_RULES: tuple[str, ...] = ("parallel-sizes", "batch-sizes")


@dataclass(frozen=True)
class Estimate:
    cfg: RecipeConfig
    """The recipe (its layout) this estimates."""
    stage: StageMemory
    rollout: RolloutMemory
    capacity_gb: float
    problems: tuple[str, ...] = ()
    """Divisibility errors of the layout itself (from the linter)."""
    nodes: tuple[NodeMemory, ...] = ()
    """GPU and host memory of each node role."""
    time: StepTime | None = None
    peaks: tuple[Term, ...] = ()
    """GPU totals outside the step (LoRA: QLoRA's start-up, a sync's merged copies; `memory.lora_peaks`)."""

    @property
    def total_gb(self) -> float:
        return self.stage.total_gb

    @property
    def margin_gb(self) -> float:
        return self.capacity_gb - self.total_gb

    @property
    def margin_pct(self) -> float:
        return 100.0 * self.margin_gb / self.capacity_gb

    @property
    def fits(self) -> bool:
        return (not self.problems and self.margin_gb >= 0 and self.rollout.fits and self.hosts_fit
                and not self.peaks_over(self.capacity_gb))

    def peaks_over(self, limit_gb: float) -> list[Term]:
        return [t for t in self.peaks if t.gb > limit_gb]

    @property
    def hosts_fit(self) -> bool:
        return all(n.host_fits for n in self.nodes)

    @property
    def comfortable(self) -> bool:
        return (self.fits and self.margin_pct >= SAFE_MARGIN_PCT
                and not self.peaks_over(self.capacity_gb * (1 - SAFE_MARGIN_PCT / 100)))


@dataclass(frozen=True)
class Suggestion:
    parallelism: ParallelismConfig
    estimate: Estimate
    cost: tuple[float, ...]

    def overrides(self) -> list[str]:
        p = self.parallelism
        return [f"parallelism.tensor_model_parallel_size={p.tensor_model_parallel_size}",
                f"parallelism.pipeline_model_parallel_size={p.pipeline_model_parallel_size}",
                f"parallelism.expert_model_parallel_size={p.expert_model_parallel_size}",
                f"parallelism.expert_tensor_parallel_size={p.expert_tensor_parallel_size}",
                f"parallelism.sequence_parallel={str(p.sequence_parallel).lower()}",
                f"parallelism.recompute_granularity={p.recompute_granularity}",
                f"parallelism.optimizer_cpu_offload={str(p.optimizer_cpu_offload).lower()}"]


@dataclass(frozen=True)
class Plan:
    recipe: str
    hardware: Hardware
    params: ModelParams
    estimate: Estimate
    suggestions: tuple[Suggestion, ...]


def layout_problems(cfg: RecipeConfig, hf: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(str(f) for name in LAYOUT_RULES for f in RULES[name](cfg, dict(hf))
                 if f.level == "error")


def estimate(cfg: RecipeConfig, params: ModelParams, hw: Hardware, problems: tuple[str, ...] = (),
             workload: Workload | None = None, rollout: Phase | None = None) -> Estimate:
    """Memory of every node role and, given a `workload`, the step's seconds (`rollout`: the
    rollout phase when already computed: it does not depend on the trainer's layout)."""
    vllm_gb = reserved_by_colocated_vllm(cfg, hw)

    def extra(s: int, in_flight: float) -> list[Term]:
        return gpu_extra_terms(cfg, params, s, in_flight)

    stage = worst_stage(params, cfg, vllm_gb, extra)
    ro = rollout_memory(params, cfg, hw)
    wl = workload or Workload.of(cfg)
    nodes = node_roles(cfg, params, stage, ro, wl, hw)
    time = step_time(params, cfg, ro, wl, gpu(hw.gpu), hw, rollout=rollout) if workload else None
    return Estimate(cfg, stage, ro, hw.gpu_memory_gb, problems, nodes, time, lora_peaks(params, cfg, vllm_gb, extra))


def node_roles(cfg: RecipeConfig, params: ModelParams, stage: StageMemory, ro: RolloutMemory,
               wl: Workload, hw: Hardware) -> tuple[NodeMemory, ...]:
    trainer = trainer_host_terms(cfg, params, stage, wl.prompt_tokens, wl.response_tokens, hw)
    capacity = hw.gpu_memory_gb
    fits = stage.total_gb <= capacity
    if cfg.rollout.placement == "colocated":
        return (NodeMemory("colocated node", cfg.parallelism.nodes, tuple(trainer + vllm_host_terms(cfg, ro)),
                           hw.host_memory_gb, stage.total_gb, capacity, fits and ro.fits),)
    rollout = NodeMemory("rollout node", cfg.rollout.nodes, tuple(vllm_host_terms(cfg, ro, params)), hw.host_memory_gb,
                         ro.reserved_gb, capacity, ro.fits)
    return (NodeMemory("trainer node", cfg.parallelism.nodes, tuple(trainer), hw.host_memory_gb, stage.total_gb,
                       capacity, fits), rollout)


def candidates(cfg: RecipeConfig, params: ModelParams) -> Iterator[ParallelismConfig]:
    p, d = cfg.parallelism, params.dims
    world = p.world_size
    tps = [t for t in TP_CHOICES if t <= p.gpus_per_node]
    pps = [n for n in range(1, MAX_PP + 1) if d.layers % n == 0]
    eps = [e for e in range(1, d.experts + 1) if d.experts % e == 0 and e <= world] or [1]
    for tp, pp, ep, recompute, offload in itertools.product(tps, pps, eps, RECOMPUTE_CHOICES,
                                                             (False, True)):
        for etp in (sorted({1, tp}) if d.experts else [None]):
            yield dataclasses.replace(
                p, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp, sequence_parallel=tp > 1 or p.sequence_parallel,
                recompute_granularity=recompute, recompute_method="uniform", recompute_num_layers=1,
                optimizer_cpu_offload=offload)


def cost(p: ParallelismConfig, est: Estimate, gpus_per_node: int, rank: str = "memory") -> tuple[float, ...]:
    """`rank` 'time': the predicted step first, then the margin; 'memory': the proxy below."""
    if rank == "time" and est.time is not None:
        return (round(est.time.seconds, 1), -est.margin_gb)
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    expert_span = p.expert_model_parallel_size * p.expert_tp
    return (float(p.optimizer_cpu_offload), float(p.recompute_granularity == "full"), float(tp * pp),
            float(pp), float(expert_span > gpus_per_node), float(expert_span), -est.margin_gb)


def search(cfg: RecipeConfig, hf: Mapping[str, Any], params: ModelParams, hw: Hardware, limit: int = 5,
           rank: str = "memory", workload: Workload | None = None) -> tuple[Suggestion, ...]:
    found: list[Suggestion] = []
    rollout = None
    if workload is not None:
        rollout = rollout_seconds(params, cfg, rollout_memory(params, cfg, hw), workload, gpu(hw.gpu), hw)[0]
    for par in candidates(cfg, params):
        trial = dataclasses.replace(cfg, parallelism=par)
        if layout_problems(trial, hf):
            continue
        est = estimate(trial, params, hw, workload=workload, rollout=rollout)
        if est.comfortable:
            found.append(Suggestion(par, est, cost(par, est, hw.gpus_per_node, rank)))
    return tuple(sorted(found, key=lambda s: s.cost)[:limit])


def plan(cfg: RecipeConfig, hf: Mapping[str, Any], hw: Hardware, limit: int = 5, rank: str = "memory",
         workload: Workload | None = None) -> Plan:
    """Estimate the recipe's own layout (memory of every node role, the step's seconds) and the
    best `limit` layouts that fit, by the memory proxy or (`rank` 'time') fastest first."""
    params = count_params(hf)
    wl = workload or Workload.of(cfg)
    own = estimate(cfg, params, hw, layout_problems(cfg, hf), wl)
    return Plan(cfg.name, hw, params, own, search(cfg, hf, params, hw, limit, rank, wl if rank == "time" else None))
