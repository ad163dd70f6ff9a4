"""torchrun worker: token-budget micro-batches vs the padded path, same layout, same checkpoint.

Run as `torchrun --nproc-per-node 2 tests/mp/budget_worker.py HF_DIR KIND OUT_JSON` (KIND: moe,
dense, or next: a Qwen3-Next with Gated DeltaNet layers). For every layout and objective, one
actor runs the padded path (fixed micro-batches of the batch's full width) and one the budget
path (length groups cut to their longest row, a different number of micro-batches per step);
rank 0 writes, per case, the largest differences of the old log-probs, the losses, the reduced
gradients of both steps and the final weights.
"""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.config.schema import AlgorithmConfig, ChordConfig, ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.megatron.microbatch import needed_lengths  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.types import TrainBatch  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from tests.mp.common import finish  # noqa: E402
from tests.mp.layouts_worker import LAYOUTS, make_batch  # noqa: E402

CASES = {
    "moe": {"tp1": ("grpo", "chord"), "tp2_sp": ("grpo",), "ep2": ("grpo",), "pp2": ("grpo", "chord"),
            "tp2_ep2_etp1": ("grpo", "chord")},
    "dense": {"tp1": ("grpo", "chord"), "tp2_sp": ("grpo",), "pp2": ("grpo", "chord")},
    "next": {"tp1": ("grpo",), "tp2_sp": ("grpo",), "pp2": ("grpo",)},        # Gated DeltaNet layers
}
# Updates against the π_old computed before the first (steps_per_generation 2): the ratio is tested.
OBJECTIVES = {
    "grpo": AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.05, entropy_coef=0.01,
                            steps_per_generation=2),
    "chord": AlgorithmConfig(name="chord", clip_eps_low=0.2, clip_eps_high=0.28, steps_per_generation=2,
                             chord=ChordConfig(rl_objective="grpo", mu_warmup_steps=1, mu_decay_steps=4, phi=True)),
}
BUDGET = 40     # 24-token rows: 1 to 4 rows per micro-batch, depending on their lengths


def add_sft(batch: TrainBatch, vocab: int, rows: int = 4, length: int = 20) -> None:
    g = torch.Generator().manual_seed(11)
    batch.sft_tokens = torch.randint(0, vocab, (rows, length), generator=g)
    batch.sft_mask = torch.zeros(rows, length - 1)
    for r, (start, stop) in enumerate([(3, 19), (2, 6), (5, 12), (4, 9)]):
        batch.sft_mask[r, start:stop] = 1.0


def grad_shards(actor: Actor) -> torch.Tensor:
    """This rank's reduced gradient: its shard of every bucket after the reduce-scatter."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    parts = []
    for group in actor.model.bucket_groups + actor.model.expert_parallel_bucket_groups:
        size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
        parts += [shard_buffer(b.grad_data, size)[rank].detach().clone() for b in group.buckets]
    return torch.cat(parts)


def run(hf_dir: str, layout: ParallelismConfig, objective: str, budget: int | None) -> dict:
    init_parallel(layout, seed=1234)
    hf = read_hf_config(hf_dir)
    actor = Actor(build_model(hf, layout, torch.float32), 2,
                  Training(TrainerConfig(lr=1e-3), layout, total_updates=10), max_tokens_per_microbatch=budget)
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    grads: list[torch.Tensor] = []
    prepare = actor.optimizer.prepare_grads

    def recording_prepare() -> bool:      # the reduced gradient, before the guarded step clips it
        grads.append(grad_shards(actor))
        return prepare()

    actor.optimizer.prepare_grads = recording_prepare
    batch = make_batch(hf["vocab_size"])
    old = actor.compute_logprobs(batch, temperature=1.0)
    # An odd row count: filler rows complete the DP split and are dropped again.
    odd = actor.compute_logprobs(batch.rows(0, 7), temperature=1.0)
    batch.old_logprobs, batch.ref_logprobs = old, old.clone() - 0.05
    if objective == "chord":
        add_sft(batch, hf["vocab_size"])
    metrics = [actor.train_step(batch, OBJECTIVES[objective], temperature=1.0, rl_step=s)
               for s in range(2)]
    weights = torch.cat([p.detach().reshape(-1).clone() for p in actor.model.parameters()])
    mbs = actor._local_microbatches(batch)
    return {"old": old, "odd": odd, "mask": batch.mask, "metrics": metrics, "grads": grads, "weights": weights,
            "microbatches": len(mbs), "widths": [mb.tokens.shape[1] for mb in mbs]}


def _max_all(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def compare(padded: dict, budget: dict) -> dict:
    # Log-probs must agree at every position up to each row's last masked target (the prompt too).
    needed = torch.tensor(needed_lengths(padded["mask"]))
    upto = torch.arange(padded["old"].shape[1]).unsqueeze(0) < (needed - 1).unsqueeze(1)
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(padded["grads"], budget["grads"]))
    grad_scale = max(float(a.abs().max()) for a in padded["grads"])
    return {
        "logprob_diff": _max_all(float(((padded["old"] - budget["old"]).abs() * upto).max())),
        "odd_rows_diff": _max_all(float(((budget["odd"] - budget["old"][:7]).abs() * upto[:7]).max())),
        "odd_rows_shape": list(budget["odd"].shape),
        "losses": [[m["loss/total"] for m in padded["metrics"]], [m["loss/total"] for m in budget["metrics"]]],
        "grad_norms": [[m["grad_norm"] for m in padded["metrics"]], [m["grad_norm"] for m in budget["metrics"]]],
        "metric_keys_same": sorted(padded["metrics"][0]) == sorted(budget["metrics"][0]),
        "grad_diff": _max_all(grad_diff), "grad_scale": _max_all(grad_scale),
        "weight_diff": _max_all(float((padded["weights"] - budget["weights"]).abs().max())),
        "microbatches": [padded["microbatches"], budget["microbatches"]],
        "budget_microbatch_counts": [int(x) for x in _gather_count(budget["microbatches"])],
        "widths": [padded["widths"], budget["widths"]],
    }


def _gather_count(n: int) -> list[int]:
    parts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, torch.tensor([n]))
    return [int(p) for p in parts]


def main() -> None:
    hf_dir, kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
    result: dict = {}
    for name, objectives in CASES[kind].items():
        for objective in objectives:
            padded = run(hf_dir, LAYOUTS[name], objective, None)
            budget = run(hf_dir, LAYOUTS[name], objective, BUDGET)
            result[f"{name}/{objective}"] = compare(padded, budget)
    finish(result, out)


if __name__ == "__main__":
    main()
