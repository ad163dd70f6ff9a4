"""torchrun worker: the same GRPO/GSPO steps under several parallel layouts, from one checkpoint.

Run as `torchrun --nproc-per-node 2 tests/mp/layouts_worker.py HF_DIR OUT_JSON`; rank 0 writes the
losses and the max |Δ| of the final weights of every layout against the first one.
"""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.config.schema import AlgorithmConfig, ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.types import TrainBatch  # noqa: E402
from megatron_rl.weights.hf_io import HFCheckpointReader  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from megatron_rl.weights.sharding import gather_to_rank0  # noqa: E402
from tests.mp.common import finish  # noqa: E402

LAYOUTS = {
    "tp1": ParallelismConfig(),
    "tp2_sp": ParallelismConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "ep2": ParallelismConfig(expert_model_parallel_size=2),
    "pp2": ParallelismConfig(pipeline_model_parallel_size=2),
    "tp2_ep2_etp1": ParallelismConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                      expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    # The output layer's logits and the chunked pass (trainer.fused_lm_head: false); every other
    # layout runs the fused head.
    "tp2_sp_unfused": ParallelismConfig(tensor_model_parallel_size=2, sequence_parallel=True),
}
# Two updates on one batch against the π_old computed before the first: steps_per_generation 2
# (at 1 the ratio is 1 by construction and the second step would not test the ratio).
OBJECTIVES = {
    "grpo": AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.05, steps_per_generation=2),
    "gspo": AlgorithmConfig(name="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, loss_agg_mode="seq-mean-token-mean",
                            steps_per_generation=2),
}


def make_batch(vocab: int, rows: int = 8, length: int = 24, seed: int = 7) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.zeros(rows, length - 1)
    for r in range(rows):
        prompt = int(torch.randint(3, 10, (1,), generator=g))
        end = int(torch.randint(prompt + 4, length, (1,), generator=g))
        mask[r, prompt - 1:end - 1] = 1.0
    adv = torch.randn(rows, generator=g)
    return TrainBatch(tokens=tokens, mask=mask, advantages=adv)


def run_layout(hf_dir: str, layout: ParallelismConfig, objective: str,
               fused: bool = True) -> tuple[list[float], dict]:
    init_parallel(layout, seed=1234)
    hf = read_hf_config(hf_dir)
    recipe = build_model(hf, layout, torch.float32)
    actor = Actor(recipe, 2, Training(TrainerConfig(lr=1e-3, clip_grad=1.0), layout, total_updates=10),
                  fused_lm_head=fused)
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()   # the optimizer's fp32 master copy follows the loaded weights
    batch = make_batch(hf["vocab_size"])
    old = actor.compute_logprobs(batch, temperature=1.0)
    batch.old_logprobs = old
    batch.ref_logprobs = old.clone()
    losses = []
    for step in range(2):
        metrics = actor.train_step(batch, OBJECTIVES[objective], temperature=1.0, rl_step=step)
        losses.append(metrics["loss/total"])
    weights, chunked, parts = {}, {}, [0, 0]
    for part in gather_to_rank0(actor.model, weight_map(hf).layers()):
        weights.update(part)
        parts[0] += 1
    # Tiny parts: a layer comes in many pieces, from several ranks at once; the same tensors.
    for part in gather_to_rank0(actor.model, weight_map(hf).layers(), chunk_bytes=1024):
        chunked.update(part)
        parts[1] += 1
    weights["__parts__"] = parts
    weights["__chunked_same__"] = sorted(chunked) == sorted(k for k in weights if k != "__parts__") and all(
        torch.equal(chunked[k], weights[k]) for k in chunked)
    return losses, weights


def main() -> None:
    import torch.distributed as dist

    hf_dir, out = sys.argv[1], sys.argv[2]
    result: dict = {}
    reader = HFCheckpointReader(hf_dir)
    adapter = weight_map(read_hf_config(hf_dir))
    initial = {e.mcore: adapter.to_mcore(e, {n: reader.get(n) for n in e.hf}) for e in adapter.entries}
    for objective in OBJECTIVES:
        ref_weights = None
        for name, layout in LAYOUTS.items():
            losses, weights = run_layout(hf_dir, layout, objective, fused=not name.endswith("_unfused"))
            entry = {"losses": losses}
            if dist.get_rank() == 0:
                entry["parts"], entry["chunked_same"] = weights.pop("__parts__"), weights.pop("__chunked_same__")
                if ref_weights is None:
                    ref_weights = weights
                    entry["num_tensors"] = len(weights)
                entry["max_weight_diff"] = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
                entry["missing"] = sorted(set(ref_weights) - set(weights))
                entry["weight_change"] = max((weights[k] - initial[k]).abs().max().item() for k in weights)
            result[f"{objective}/{name}"] = entry
    finish(result, out)


if __name__ == "__main__":
    main()
