"""torchrun worker: CHORD steps give the same losses whatever the split of the expert rows.

Run as `torchrun --nproc-per-node 2 tests/mp/chord_split_worker.py HF_DIR OUT_JSON`. 8 rollout rows
and 2 expert rows, micro-batches of 1: under DP 2 each rank has 4 micro-batches and 1 expert row (3
micro-batches carry none); under PP 2 (DP 1) 8 micro-batches share 2 expert rows and the stages
exchange micro-batches of different sizes.
"""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from layouts_worker import make_batch  # noqa: E402

from megatron_rl.config.schema import AlgorithmConfig, ChordConfig, ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from tests.mp.common import finish  # noqa: E402

LAYOUTS = {"dp2": ParallelismConfig(), "pp2": ParallelismConfig(pipeline_model_parallel_size=2)}
CHORD = AlgorithmConfig(name="chord", chord=ChordConfig(mu_peak=0.5, mu_valley=0.5))


def run(hf_dir: str, layout: ParallelismConfig) -> list[float]:
    init_parallel(layout, seed=1234)
    hf = read_hf_config(hf_dir)
    actor = Actor(build_model(hf, layout, torch.float32), 1,
                  Training(TrainerConfig(lr=1e-3), layout, total_updates=10))
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    batch = make_batch(hf["vocab_size"])
    sft = make_batch(hf["vocab_size"], rows=2, length=20, seed=11)
    batch.old_logprobs = actor.compute_logprobs(batch, temperature=1.0)
    batch.sft_tokens, batch.sft_mask = sft.tokens, sft.mask
    return [actor.train_step(batch, CHORD, temperature=1.0, rl_step=s)["loss/total"] for s in range(2)]


def main() -> None:

    hf_dir, out = sys.argv[1], sys.argv[2]
    result = {name: run(hf_dir, layout) for name, layout in LAYOUTS.items()}
    finish(result, out)


if __name__ == "__main__":
    main()
