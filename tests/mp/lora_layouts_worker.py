"""torchrun worker: the same LoRA GRPO steps under several parallel layouts, from one checkpoint.

Run as `torchrun --nproc-per-node 2 tests/mp/lora_layouts_worker.py HF_DIR KIND OUT_JSON` (KIND: moe,
moe_experts, dense or next); rank 0 writes, per layout, the losses, the full (unsharded) adapter gradients of the first
step and adapter weights after the last, and the checks of the base (frozen, disabled = initial
model, merged = adapted model). The distributed optimizer is off here: its reduce-scatter leaves
each DP rank only its own shard of the gradient buffer, and the full gradients are the point.
"""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

from megatron_rl.config.schema import AlgorithmConfig, LoraConfig, ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.megatron.lora import adapter_shards, adapters_disabled, merged_deltas  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from tests.mp.common import finish  # noqa: E402
from tests.mp.layouts_worker import make_batch  # noqa: E402

NO_DIST_OPT = dict(use_distributed_optimizer=False)
LAYOUTS = {
    "tp1": ParallelismConfig(**NO_DIST_OPT),
    "tp2_sp": ParallelismConfig(tensor_model_parallel_size=2, sequence_parallel=True, **NO_DIST_OPT),
    "tp2": ParallelismConfig(tensor_model_parallel_size=2, **NO_DIST_OPT),
    "pp2": ParallelismConfig(pipeline_model_parallel_size=2, **NO_DIST_OPT),
    "ep2": ParallelismConfig(expert_model_parallel_size=2, **NO_DIST_OPT),
    "tp2_ep2_etp1": ParallelismConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                      expert_model_parallel_size=2, expert_tensor_parallel_size=1, **NO_DIST_OPT),
}
# MoE training refuses TP without SP: the plain-TP paths (copy/reduce instead of gather/reduce-scatter
# of the rank-r activation) run on the dense model.
KIND_LAYOUTS = {"moe": ["tp1", "tp2_sp", "pp2", "ep2", "tp2_ep2_etp1"], "dense": ["tp1", "tp2", "tp2_sp", "pp2"],
                "next": ["tp1", "tp2_sp", "pp2"],
                # Expert adapters need expert-TP 1: tp2_sp would split the experts over TP.
                "moe_experts": ["tp1", "pp2", "ep2", "tp2_ep2_etp1"]}
LORA = LoraConfig(rank=4, alpha=8.0, targets=["q", "k", "v", "o"])
LORA_EXPERTS = LoraConfig(rank=4, alpha=8.0, targets=["q", "k", "v", "o", "experts"])
ALGO = AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.05, steps_per_generation=2)


def full_adapters(actor: Actor, grads: bool) -> dict[str, list]:
    """Global adapter tensors (or their gradients) assembled on rank 0 from the TP shards of the
    first data-parallel replica ({} elsewhere)."""
    mine = []
    for s in adapter_shards(actor.model):
        expert = getattr(s.param, "allreduce", True) is False
        dp_rank = ps.get_expert_data_parallel_rank() if expert else ps.get_data_parallel_rank()
        tp_rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
        if dp_rank == 0:
            t = s.param.main_grad if grads else s.param
            mine.append((s.name, s.tp_dim, tp_rank, t.detach().double().cpu()))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int | None] = {}
    for part in everyone:
        for name, dim, tp_rank, t in part:
            pieces.setdefault(name, {})[tp_rank] = t
            dims[name] = dim
    out = {}
    for name, by_rank in pieces.items():
        dim = dims[name]
        full = by_rank[0] if dim is None else torch.cat([by_rank[r] for r in sorted(by_rank)], dim=dim)
        out[name] = full.tolist()
    return out


def run_layout(hf_dir: str, layout: ParallelismConfig, lora: LoraConfig) -> dict:
    init_parallel(layout, seed=1234)
    hf = read_hf_config(hf_dir)
    recipe = build_model(hf, layout, torch.float32)
    actor = Actor(recipe, 2, Training(TrainerConfig(lr=1e-3, clip_grad=0.0), layout, total_updates=10), lora=lora)
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    frozen = {n: p.detach().clone() for n, p in actor.model.named_parameters() if not p.requires_grad}
    batch = make_batch(hf["vocab_size"])
    old = actor.compute_logprobs(batch, temperature=1.0)
    batch.old_logprobs, batch.ref_logprobs = old, old.clone()
    losses, grad_norms, grads = [], [], {}
    for step in range(2):
        metrics = actor.train_step(batch, ALGO, temperature=1.0, rl_step=step)
        losses.append(metrics["loss/total"])
        grad_norms.append(metrics["grad_norm"])
        if step == 0:
            grads = full_adapters(actor, grads=True)
    adapted = actor.compute_logprobs(batch, temperature=1.0)
    with adapters_disabled(actor.model):
        disabled = actor.compute_logprobs(batch, temperature=1.0)
    with merged_deltas(actor.model) as touched:
        merged = actor.compute_logprobs(batch, temperature=1.0)
    return {
        "losses": losses, "grad_norms": grad_norms, "grads": grads, "weights": full_adapters(actor, grads=False),
        "adapted_moved": (adapted - old).abs().max().item(),
        "disabled_diff": (disabled - old).abs().max().item(),
        "merged_diff": (merged - adapted).abs().max().item(),
        "touched": sorted(touched),
        "base_unchanged": all(torch.equal(p, frozen[n]) for n, p in actor.model.named_parameters()
                              if not p.requires_grad),
        "optimizer_params": sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"]),
        "trainable": actor.lora.trainable if actor.lora else 0,
    }


def main() -> None:
    hf_dir, kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
    lora = LORA_EXPERTS if kind == "moe_experts" else LORA
    result = {name: run_layout(hf_dir, LAYOUTS[name], lora) for name in KIND_LAYOUTS[kind]}
    finish(result, out)


if __name__ == "__main__":
    main()
