"""torchrun worker: a tiny Qwen3-Next in Megatron under several layouts, against HF.

`torchrun --nproc-per-node N tests/mp/qwen3_next_worker.py HF_DIR REF_PT OUT_DIR LAYOUT...`
REF_PT holds `tokens` and HF's fp32 `logits` for them. Per layout, rank 0 writes to
OUT_DIR/result.json: the max |Δ| of Megatron's logits (weights loaded through the adapter) against
HF's, the HF tensors that do not come back bit-identical (HF → Megatron → HF), and the losses and
gradient norms of two GRPO steps (forward + backward + Adam through the Actor); and to
OUT_DIR/LAYOUT.pt the first step's full gradients and the final weights, to compare layouts.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region  # noqa: E402

from megatron_rl.config.schema import ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel, unwrap  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.weights.hf_io import HFCheckpointReader  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from megatron_rl.weights.sharding import gather_to_rank0, local_params, unshard  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from layouts_worker import OBJECTIVES, make_batch  # noqa: E402

from tests.mp.common import finish  # noqa: E402

LAYOUTS = {
    "tp1": ParallelismConfig(),
    "tp2_sp": ParallelismConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "ep2": ParallelismConfig(expert_model_parallel_size=2),
    "pp2": ParallelismConfig(pipeline_model_parallel_size=2),
}


def logits_diff(actor: Actor, ref: dict[str, torch.Tensor]) -> float | None:
    """Max |Δ| of the full-vocabulary logits against HF (None under pipeline parallelism, where one
    stage alone has no logits)."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        return None
    model = unwrap(actor.model)
    model.eval()
    tokens = ref["tokens"]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        local = model(tokens, positions, None)        # [b, s, vocab / TP]
        full = gather_from_tensor_model_parallel_region(local)
    return (full - ref["logits"]).abs().max().item()


def round_trip(actor: Actor, hf_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Megatron's full tensors on rank 0, and the HF tensors that do not come back bit-identical."""
    adapter = weight_map(read_hf_config(hf_dir))
    full: dict[str, torch.Tensor] = {}
    for part in gather_to_rank0(actor.model, adapter.layers()):
        full.update(part)
    if dist.get_rank() != 0:
        return full, {}
    reader = HFCheckpointReader(hf_dir)
    back = {name: t for e in adapter.entries if e.mcore in full for name, t in adapter.to_hf(e, full[e.mcore])}
    expected = set(reader.names())
    report = {
        "missing": sorted(expected - set(back)),
        "extra": sorted(set(back) - expected),
        "not_equal": sorted(n for n in expected & set(back) if not torch.equal(back[n], reader.get(n))),
    }
    return full, report


def step_one_grads(actor: Actor) -> dict[str, torch.Tensor] | None:
    """Full gradients of every tensor after the first step, on rank 0; None where data parallelism
    leaves each rank only its distributed-optimizer shard of the reduced gradients."""
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1 or \
            ps.get_expert_data_parallel_world_size() > 1:
        return None
    mine = {}
    for p in local_params(actor.model):
        full = unshard(dataclasses.replace(p, param=p.param.main_grad))
        if p.owns():
            mine[p.global_name] = full
    parts: list[dict[str, torch.Tensor]] | None = [{} for _ in range(dist.get_world_size())] \
        if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {k: v for part in parts or [] for k, v in part.items()} or None


def run_layout(hf_dir: str, layout: ParallelismConfig, ref: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    init_parallel(layout, seed=1234)
    hf = read_hf_config(hf_dir)
    actor = Actor(build_model(hf, layout, torch.float32), 2,
                  Training(TrainerConfig(lr=1e-3), layout, total_updates=10))
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    result: dict = {"max_logit_diff": logits_diff(actor, ref)}
    _, result["round_trip"] = round_trip(actor, hf_dir)
    batch = make_batch(hf["vocab_size"], rows=4, length=80)   # > 64: two chunks of the delta rule
    batch.old_logprobs = actor.compute_logprobs(batch, temperature=1.0)
    batch.ref_logprobs = batch.old_logprobs.clone()
    steps = [actor.train_step(batch, OBJECTIVES["grpo"], temperature=1.0, rl_step=0)]
    grads = step_one_grads(actor)
    steps.append(actor.train_step(batch, OBJECTIVES["grpo"], temperature=1.0, rl_step=1))
    result["losses"] = [m["loss/total"] for m in steps]
    result["grad_norms"] = [m["grad_norm"] for m in steps]
    trained, _ = round_trip(actor, hf_dir)
    return result, {"weights": trained, "grads": grads}


def main() -> None:
    hf_dir, ref_path, out, *names = sys.argv[1:]
    ref = torch.load(ref_path)
    results: dict = {}
    for name in names:
        results[name], tensors = run_layout(hf_dir, LAYOUTS[name], ref)
        if dist.get_rank() == 0:
            torch.save(tensors, f"{out}/{name}.pt")
    finish(results, f"{out}/result.json")


if __name__ == "__main__":
    main()
