"""torchrun worker: the recipe's memory options reach megatron-core and change what it builds.

Run as `torchrun --nproc-per-node 2 tests/mp/memory_options_worker.py HF_DIR OUT_JSON` (DP 2).
For each option set, rank 0 records what megatron-core built (TransformerConfig recompute fields,
optimizer classes, DDP flags), the activation bytes one forward keeps for backward, the gradients
of that forward, the losses of two GRPO steps and the final weights' max |Δ| against the defaults.
"""

from __future__ import annotations

import json
import sys

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from layouts_worker import make_batch  # noqa: E402
from megatron.core.pipeline_parallel.schedules import custom_backward  # noqa: E402

from megatron_rl.config.schema import AlgorithmConfig, ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel, unwrap  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from megatron_rl.weights.sharding import gather_to_rank0  # noqa: E402

FP32, BF16 = torch.float32, torch.bfloat16
# name → (options, params dtype, the run it must reproduce). Host offload keeps the fp32 master copy
# of bf16 weights (megatron-core offloads only that), so it is compared with the bf16 default.
OPTIONS = {
    "default": (ParallelismConfig(), FP32, "default"),
    "recompute_full": (ParallelismConfig(recompute_granularity="full", recompute_num_layers=1), FP32, "default"),
    "recompute_block": (ParallelismConfig(recompute_granularity="full", recompute_method="block",
                                          recompute_num_layers=1), FP32, "default"),
    "recompute_selective": (ParallelismConfig(recompute_granularity="selective"), FP32, "default"),
    "plain_optimizer": (ParallelismConfig(use_distributed_optimizer=False), FP32, "default"),
    "overlap": (ParallelismConfig(overlap_grad_reduce=True, overlap_param_gather=True), FP32, "default"),
    "default_bf16": (ParallelismConfig(), BF16, "default_bf16"),
    "cpu_offload_bf16": (ParallelismConfig(optimizer_cpu_offload=True), BF16, "default_bf16"),
}
MEMORY_OPTIONS = ("default", "recompute_full", "recompute_block", "recompute_selective")


def saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, dict]:
    """Bytes of the tensors autograd keeps for backward after one forward (parameters excluded,
    shared storages counted once), and the gradients of sum(logits)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    # The batch is built on the host; the model sits on the rank's device (a GPU in the GPU test).
    tokens = tokens.to(next(model.parameters()).device)
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens, positions, None)
    # Megatron's own backward entry (the schedules' one with deallocate_pipeline_outputs).
    custom_backward(logits.float().square().mean(), None)
    # DDP's hooks accumulate into `main_grad` (its grad buffer), zeroed by the caller.
    grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    return sum(seen.values()), grads


def built(actor: Actor) -> dict:
    c = actor.config
    opt = actor.optimizer
    parts = getattr(opt, "chained_optimizers", [opt])
    ddp = actor.model.ddp_config
    return {
        "recompute": [c.recompute_granularity, c.recompute_method, c.recompute_num_layers],
        "optimizers": sorted({type(p).__name__ for p in parts}),
        "inner_optimizers": sorted({type(p.optimizer).__name__ for p in parts}),
        "offload_fraction": [p.config.optimizer_offload_fraction for p in parts if p.config.optimizer_cpu_offload],
        "ddp": [ddp.use_distributed_optimizer, ddp.overlap_grad_reduce, ddp.overlap_param_gather],
    }


def run(hf_dir: str, name: str, layout: ParallelismConfig, dtype: torch.dtype) -> dict:
    import torch.distributed as dist

    init_parallel(layout, seed=1234)
    hf = read_hf_config(hf_dir)
    actor = Actor(build_model(hf, layout, dtype), 2,
                  Training(TrainerConfig(lr=1e-3), layout, total_updates=10))
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    entry: dict = {"built": built(actor)}
    batch = make_batch(hf["vocab_size"])
    if name in MEMORY_OPTIONS:
        # Straight through the GPTModel (no DDP hooks): what recompute changes is what it keeps.
        actor.model.zero_grad_buffer()
        nbytes, grads = saved_activation_bytes(unwrap(actor.model), batch.tokens[:2])
        actor.model.zero_grad_buffer()
        entry["activation_bytes"] = nbytes
        entry["grads"] = grads
    if layout.optimizer_cpu_offload and not torch.cuda.is_available():
        # HybridDeviceOptimizer offloads the parameters that are on a GPU; with none, its step
        # has nothing to map back (megatron-core 0.19). The GPU test runs this step.
        dist.barrier()
        return entry
    batch.old_logprobs = actor.compute_logprobs(batch, temperature=1.0)
    algorithm = AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.28, steps_per_generation=2)
    entry["losses"] = [actor.train_step(batch, algorithm, temperature=1.0, rl_step=s)["loss/total"] for s in range(2)]
    weights: dict = {}
    for part in gather_to_rank0(actor.model, weight_map(hf).layers()):
        weights.update(part)
    entry["weights"] = weights
    dist.barrier()
    return entry


def main() -> None:
    import torch.distributed as dist

    hf_dir, out = sys.argv[1], sys.argv[2]
    entries = {name: run(hf_dir, name, layout, dtype) for name, (layout, dtype, _) in OPTIONS.items()}
    if dist.get_rank() == 0:
        result = {}
        for name, e in entries.items():
            ref = entries[OPTIONS[name][2]]
            r = {k: e[k] for k in ("built", "losses") if k in e}
            if "weights" in e:
                r["max_weight_diff"] = max((e["weights"][k].float() - ref["weights"][k].float()).abs().max().item()
                                           for k in ref["weights"])
            if "grads" in e:
                r["activation_bytes"] = e["activation_bytes"]
                r["max_grad_diff"] = max((e["grads"][k] - ref["grads"][k]).abs().max().item() for k in ref["grads"])
                r["num_grads"] = len(e["grads"])
            result[name] = r
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
