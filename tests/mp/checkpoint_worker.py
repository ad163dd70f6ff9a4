"""torchrun worker: save a dist-checkpoint at one layout, load it at others, compare logits.

`torchrun --nproc-per-node 2 tests/mp/checkpoint_worker.py HF_DIR CKPT_DIR OUT_JSON`.
"""

from __future__ import annotations

import sys

import psutil
import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.config.schema import AlgorithmConfig, ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.megatron.checkpoint import OptimizerLayoutMismatch, load_checkpoint, save_checkpoint  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from layouts_worker import LAYOUTS, make_batch  # noqa: E402

from tests.mp.common import finish  # noqa: E402


def build(hf_dir: str, layout: ParallelismConfig) -> Actor:
    init_parallel(layout, seed=1234)
    return Actor(build_model(read_hf_config(hf_dir), layout, torch.float32),
                 2, Training(TrainerConfig(lr=1e-3), layout, total_updates=10))


def logprobs(actor: Actor, batch) -> torch.Tensor:  # noqa: ANN001
    return actor.compute_logprobs(batch, temperature=1.0)


def main() -> None:
    hf_dir, ckpt, out = sys.argv[1:4]
    hf = read_hf_config(hf_dir)
    batch = make_batch(hf["vocab_size"])
    # Train one step at TP2+SP so the checkpoint holds non-initial weights and optimizer state.
    actor = build(hf_dir, LAYOUTS["tp2_sp"])
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    batch.old_logprobs = logprobs(actor, batch)
    actor.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=0)
    reference = logprobs(actor, batch)
    save_checkpoint(actor, ckpt, extra={"epoch": 3})
    # The writer's results stayed in this process: no multiprocessing manager was spawned for them.
    spawned = [p.cmdline() for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
    actor.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=1)
    after_step = logprobs(actor, batch)
    result = {}
    for name, layout in LAYOUTS.items():
        if name.endswith("_unfused"):   # the same layout on the logits path: nothing new to load
            continue
        other = build(hf_dir, layout)
        try:
            extra = load_checkpoint(other, ckpt)
            optimizer_loaded = True
        except OptimizerLayoutMismatch:
            extra = load_checkpoint(other, ckpt, load_optimizer=False)
            optimizer_loaded = False
        entry = {"max_logprob_diff": (logprobs(other, batch) - reference).abs().max().item(),
                 "step": other.step, "extra": extra, "optimizer_loaded": optimizer_loaded}
        if optimizer_loaded:
            # Same optimizer state ⇒ the next step is the same as the saver's next step.
            other.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=1)
            entry["logprob_diff_after_step"] = (logprobs(other, batch) - after_step).abs().max().item()
        result[name] = entry
    finish({"layouts": result, "spawned_by_save": spawned}, out)


if __name__ == "__main__":
    main()
