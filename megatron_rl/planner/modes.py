"""Full, LoRA and QLoRA side by side, and the fewest nodes each needs.

`compare(cfg, hf, hw)` plans the recipe three times — the whole model trained (`lora.rank` 0), LoRA
on a frozen bf16 base, and QLoRA on an NF4 base (`lora.py` has the byte model) — at the recipe's
own layout, and for each finds the fewest trainer nodes (of `hw.gpus_per_node` GPUs of
`hw.gpu_memory_gb`) on which the layout search (`plan.search`: the linter's divisibility rules,
SAFE_MARGIN_PCT of the card to spare) finds a layout. The rollout servers run on their own nodes
(`rollout.placement: disaggregated`); `rollout_nodes` is the fewest that hold one vLLM server of
the recipe's TP × DP with room for a max-length sequence, so the total a run needs is
trainer + rollout nodes. A recipe without a rank uses DEFAULT_RANK (the published QLoRA run's r 8).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config.schema import LoraConfig, RecipeConfig
from .memory import Hardware, rollout_memory
from .params import ModelParams, count_params
from .plan import Estimate, Suggestion, estimate, layout_problems, search

MODES: tuple[str, ...] = ("full", "lora", "qlora")
DEFAULT_RANK = 8
MAX_NODES = 64


@dataclass(frozen=True)
class ModeAnswer:
    mode: str
    lora: LoraConfig
    own: Estimate
    """The recipe's own layout under this mode."""
    trainer_nodes: int | None
    """Fewest trainer nodes with a layout that fits (None: not within MAX_NODES)."""
    best: Suggestion | None
    """The search's first layout at that node count."""
    rollout_nodes: int | None

    @property
    def total_nodes(self) -> int | None:
        if self.trainer_nodes is None or self.rollout_nodes is None:
            return None
        return self.trainer_nodes + self.rollout_nodes


def mode_lora(cfg: RecipeConfig, mode: str) -> LoraConfig:
    if mode == "full":
        return dataclasses.replace(cfg.lora, rank=0, base_quantization="none")
    rank = cfg.lora.rank or DEFAULT_RANK
    return dataclasses.replace(cfg.lora, rank=rank, base_quantization="nf4" if mode == "qlora" else "none")


def with_nodes(cfg: RecipeConfig, nodes: int) -> RecipeConfig:
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, nodes=nodes))


def fewest_trainer_nodes(cfg: RecipeConfig, hf: Mapping[str, Any], params: ModelParams, hw: Hardware,
                         max_nodes: int = MAX_NODES) -> tuple[int | None, Suggestion | None]:
    for nodes in range(1, max_nodes + 1):
        found = search(with_nodes(cfg, nodes), hf, params, hw, limit=1)
        if found:
            return nodes, found[0]
    return None, None


def fewest_rollout_nodes(cfg: RecipeConfig, params: ModelParams, hw: Hardware,
                         max_nodes: int = MAX_NODES) -> int | None:
    if cfg.rollout.placement != "disaggregated":
        return 0                      # colocated: the trainer's nodes (their memory is in its plan)
    for nodes in range(1, max_nodes + 1):
        trial = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, nodes=nodes))
        if rollout_memory(params, trial, hw).fits:
            return nodes
    return None


def compare(cfg: RecipeConfig, hf: Mapping[str, Any], hw: Hardware,
            max_nodes: int = MAX_NODES) -> tuple[ModeAnswer, ...]:
    params = count_params(hf)
    out = []
    for mode in MODES:
        trial = dataclasses.replace(cfg, lora=mode_lora(cfg, mode))
        own = estimate(trial, params, hw, layout_problems(trial, hf))
        nodes, best = fewest_trainer_nodes(trial, hf, params, hw, max_nodes)
        out.append(ModeAnswer(mode, trial.lora, own, nodes, best, fewest_rollout_nodes(trial, params, hw, max_nodes)))
    return tuple(out)


def render_modes(answers: tuple[ModeAnswer, ...], hw: Hardware) -> str:
    lines = [f"full / LoRA / QLoRA on {hw.gpus_per_node}-GPU {hw.gpu_memory_gb:g} GB nodes "
             "(trainer GB/GPU at the recipe's layout; fewest nodes with a layout that fits):",
             f"  {'mode':<6} {'rank':>4} {'base':<5} {'weights':>8} {'grads':>7} {'optim':>7} {'total':>7}"
             f"  {'trainer':>7} {'rollout':>7} {'nodes':>5}  best layout"]
    for a in answers:
        t = {term.key: term.gb for term in a.own.stage.terms}
        best = _layout(a.best) if a.best else "-"
        lines.append(f"  {a.mode:<6} {a.lora.rank:>4} {a.lora.base_quantization:<5} {t['weights']:>8.1f} "
                     f"{t['gradients']:>7.1f} {t['optimizer']:>7.1f} {a.own.total_gb:>7.1f}  "
                     f"{_n(a.trainer_nodes):>7} {_n(a.rollout_nodes):>7} {_n(a.total_nodes):>5}  {best}")
    return "\n".join(lines) + "\n"


def _layout(s: Suggestion) -> str:
    p = s.parallelism
    return (f"TP{p.tensor_model_parallel_size} PP{p.pipeline_model_parallel_size} "
            f"EP{p.expert_model_parallel_size} ETP{p.expert_tensor_parallel_size}, "
            f"recompute {p.recompute_granularity}, optimizer on {'CPU' if p.optimizer_cpu_offload else 'GPU'}: "
            f"{s.estimate.total_gb:.1f} GB/GPU")


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def modes_json(answers: tuple[ModeAnswer, ...]) -> dict[str, Any]:
    return {a.mode: {"rank": a.lora.rank, "base_quantization": a.lora.base_quantization,
                     "terms_gb": {t.key: round(t.gb, 3) for t in a.own.stage.terms},
                     "total_gb": round(a.own.total_gb, 3), "trainer_nodes": a.trainer_nodes,
                     "rollout_nodes": a.rollout_nodes, "total_nodes": a.total_nodes,
                     "best_layout": a.best.overrides() if a.best else None,
                     "best_layout_gb": round(a.best.estimate.total_gb, 3) if a.best else None}
            for a in answers}
