"""torchrun worker: LoRA dropout (PEFT's `lora_dropout`) on the adapters' input path.

Run as `torchrun --nproc-per-node 2 tests/mp/lora_dropout_worker.py HF_DIR OUT_JSON` on a dense
tiny model. Per layout (tp1 = two data-parallel ranks, tp2, tp2 with SP) rank 0 writes:
- the dropout calls of one training forward per adapter (q/k/v: one mask each, o: one), whether
  the masks of a replicated input agree over the TP ranks and those of a split input differ;
- the adapter's output averaged over many training forwards against its eval output (dropout is
  unbiased: E[B·A·dropout(x)] = B·A·x), and the eval log-probs with and without dropout;
- the GSPO clip counts of an update at steps_per_generation 1 (π_old = the training forward itself:
  never clipped) and of the first update at steps_per_generation 2 (π_old from the eval forward:
  dropout noise alone clips at ε 3e-4).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

from megatron_rl.config.schema import AlgorithmConfig, LoraConfig, ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron import lora as lora_mod  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from tests.mp.common import finish  # noqa: E402
from tests.mp.layouts_worker import make_batch  # noqa: E402

NO_DIST_OPT = dict(use_distributed_optimizer=False)
LAYOUTS = {
    "tp1": ParallelismConfig(**NO_DIST_OPT),
    "tp2": ParallelismConfig(tensor_model_parallel_size=2, **NO_DIST_OPT),
    "tp2_sp": ParallelismConfig(tensor_model_parallel_size=2, sequence_parallel=True, **NO_DIST_OPT),
}
P = 0.3
GSPO = dict(name="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, loss_agg_mode="seq-mean-token-mean")


def _actor(hf_dir: str, layout: ParallelismConfig, dropout: float) -> Actor:
    init_parallel(layout, seed=1234)
    hf = read_hf_config(hf_dir)
    recipe = build_model(hf, layout, torch.float32)
    lora = LoraConfig(rank=4, alpha=8.0, targets=["q", "k", "v", "o"], dropout=dropout)
    actor = Actor(recipe, 2, Training(TrainerConfig(lr=1e-3, clip_grad=0.0), layout, total_updates=10), lora=lora)
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    g = torch.Generator().manual_seed(5)
    for m in lora_mod.lora_modules(actor.model):     # B ≠ 0: the adapters contribute from the start
        with torch.no_grad():
            m.b.copy_(torch.randn(m.b.shape, generator=g) * 0.5)
    return actor


def _recorded_masks(actor: Actor, batch: Any) -> dict[str, list[torch.Tensor]]:
    """The dropout masks each adapter drew in one training forward (in call order)."""
    masks: dict[str, list[torch.Tensor]] = {}
    real = lora_mod._Adapter.dropped

    def spy(self: Any, x: torch.Tensor) -> torch.Tensor:
        out = real(self, x)
        if out is not x:
            masks.setdefault(self.name, []).append((out != 0).flatten().clone())
        return out

    lora_mod._Adapter.dropped = spy  # type: ignore[method-assign]
    try:
        actor.model.train()
        with torch.no_grad():
            actor._run(actor._local_microbatches(batch),
                       lambda mb, t, out: (actor._logprobs(out, t, 1.0, with_entropy=False)[0].sum() * 0.0,
                                           torch.tensor(1), {}),
                       forward_only=True, replay=False, temperature=1.0, with_entropy=False)
    finally:
        lora_mod._Adapter.dropped = real  # type: ignore[method-assign]
    return masks


def _same_over_tp(t: torch.Tensor) -> bool:
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def _mean_matches(actor: Actor) -> float:
    """max |mean over draws of the training-mode adapter output − its eval output| / scale."""
    adapter = next(m for m in lora_mod.lora_modules(actor.model) if isinstance(m, lora_mod.ColumnAdapter))
    w = adapter.base.weight
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 1, w.shape[1], generator=g)
    if adapter.sequence_parallel:
        x = x[: 4 // ps.get_tensor_model_parallel_world_size()]
    adapter.eval()
    with torch.no_grad():
        expected = adapter.delta_output(x)
        adapter.train()
        draws = 3000
        mean = sum(adapter.delta_output(x) for _ in range(draws)) / draws
    return float((mean - expected).abs().max() / expected.abs().max())


def run_layout(hf_dir: str, name: str) -> dict:
    layout = LAYOUTS[name]
    actor = _actor(hf_dir, layout, P)
    hf = read_hf_config(hf_dir)
    batch = make_batch(hf["vocab_size"])
    masks = _recorded_masks(actor, batch)
    column = {k: v for k, v in masks.items() if k.endswith("lora_qkv")}
    row = {k: v for k, v in masks.items() if k.endswith("lora_proj")}
    result: dict[str, Any] = {
        "calls": {k: len(v) for k, v in masks.items()},
        "qkv_masks_differ": all(not torch.equal(v[0], v[1]) and not torch.equal(v[1], v[2]) for v in column.values()),
        "kept_frac": float(torch.cat([m.float() for v in masks.values() for m in v]).mean().item()),
        "column_same_over_tp": all(_same_over_tp(m) for v in column.values() for m in v),
        "row_same_over_tp": all(_same_over_tp(m) for v in row.values() for m in v),
        "mean_rel_err": _mean_matches(actor),
    }
    old = actor.compute_logprobs(batch, temperature=1.0)
    again = actor.compute_logprobs(batch, temperature=1.0)
    result["eval_deterministic"] = bool(torch.equal(old, again))
    batch.old_logprobs, batch.ref_logprobs = old, old.clone()
    for spg in (1, 2):
        metrics = actor.train_step(batch, AlgorithmConfig(**GSPO, steps_per_generation=spg),
                                   temperature=1.0, rl_step=0)
        result[f"clipped_spg{spg}"] = sum(v for k, v in metrics.items() if "clip_" in k and "frac" in k)
        result.setdefault("metric_keys", sorted(metrics))
    no_dropout = _actor(hf_dir, layout, 0.0)
    result["eval_equals_no_dropout"] = bool(torch.allclose(no_dropout.compute_logprobs(batch, temperature=1.0),
                                                           old, rtol=0, atol=1e-6))
    return result


def main() -> None:
    hf_dir, out = sys.argv[1], sys.argv[2]
    result = {name: run_layout(hf_dir, name) for name in LAYOUTS}
    finish(result, out)


if __name__ == "__main__":
    main()
