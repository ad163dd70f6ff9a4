"""torchrun worker: LoRA checkpoints hold the adapters only, resume exactly, load at other layouts,
and merge into a real HF export (`megatron-rl convert mcore-to-hf` on the saved checkpoint).

`torchrun --nproc-per-node 2 tests/mp/lora_checkpoint_worker.py HF_DIR CKPT_DIR OUT_JSON [experts]`: the
actor trains one LoRA step at TP2+SP (with `experts`: adapters on the experts too, at TP2+SP+EP2,
expert-TP 1) and saves; a second step gives the expected log-probs. Fresh actors (base from HF,
adapters from the checkpoint) then take the same second step.
"""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

import torch.distributed as dist  # noqa: E402

from megatron_rl.config.schema import ParallelismConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.megatron.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from megatron_rl.megatron.lora import merged_deltas  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.types import TrainBatch  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from megatron_rl.weights.lora_base import lora_record  # noqa: E402
from megatron_rl.weights.sharding import gather_hf_layers  # noqa: E402
from tests.mp.layouts_worker import LAYOUTS, make_batch  # noqa: E402
from tests.mp.lora_layouts_worker import ALGO, LORA, LORA_EXPERTS  # noqa: E402

from megatron_rl.config.schema import LoraConfig, TrainerConfig  # noqa: E402  isort: skip
from tests.mp.common import finish  # noqa: E402


def build(hf_dir: str, layout: ParallelismConfig, lora: LoraConfig) -> Actor:
    init_parallel(layout, seed=1234)
    hf = read_hf_config(hf_dir)
    actor = Actor(build_model(hf, layout, torch.float32), 2,
                  Training(TrainerConfig(lr=1e-3), layout, total_updates=10), lora=lora)
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    return actor


def step(actor: Actor, batch: TrainBatch, rl_step: int) -> torch.Tensor:
    actor.train_step(batch, ALGO, temperature=1.0, rl_step=rl_step)
    return actor.compute_logprobs(batch, temperature=1.0)


def merged_hf(actor: Actor, hf_dir: str) -> dict[str, torch.Tensor]:
    """The adapted model's full HF tensors (rank 0), as an export of W + ΔW would write them."""
    out: dict[str, torch.Tensor] = {}
    with merged_deltas(actor.model):
        for layer in gather_hf_layers(actor.model, weight_map(read_hf_config(hf_dir))):
            out.update({k: v.clone() for k, v in layer})    # rank 0's own tensors alias the parameters
    return out


def main() -> None:
    hf_dir, ckpt, out = sys.argv[1:4]
    lora = LORA_EXPERTS if sys.argv[4:] == ["experts"] else LORA
    saver, others = ("tp2_ep2_etp1", ("tp2_ep2_etp1", "pp2", "tp1")) if lora is LORA_EXPERTS else \
        ("tp2_sp", ("tp2_sp", "pp2", "tp1"))
    batch = make_batch(read_hf_config(hf_dir)["vocab_size"])
    actor = build(hf_dir, LAYOUTS[saver], lora)
    batch.old_logprobs = actor.compute_logprobs(batch, 1.0)
    batch.ref_logprobs = batch.old_logprobs.clone()
    saved = step(actor, batch, 0)
    save_checkpoint(actor, ckpt, extra=lora_record(lora.rank, lora.alpha, lora.targets, hf_dir, hf_dir))
    export = merged_hf(actor, hf_dir)          # what `convert mcore-to-hf` must write from the checkpoint
    expected = step(actor, batch, 1)
    result: dict = {"moved": (expected - saved).abs().max().item(), "saver": saver}
    for name in others:
        other = build(hf_dir, LAYOUTS[name], lora)
        # The adapter state resharded onto this layout; the optimizer state where the layout's
        # dense/expert optimizer split matches the saver's (as full checkpoints).
        load_checkpoint(other, ckpt, load_optimizer=name != "pp2")
        entry = {"loaded_diff": (other.compute_logprobs(batch, 1.0) - saved).abs().max().item()}
        if name != "pp2":
            entry["resumed_diff"] = (step(other, batch, 1) - expected).abs().max().item()
        result[name] = entry
    if dist.get_rank() == 0:
        torch.save(export, f"{out}.export.pt")
    finish(result, out)


if __name__ == "__main__":
    main()
