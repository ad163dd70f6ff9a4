"""torchrun worker: a policy started from a converted Megatron dist-checkpoint has the same log-probs
as one started from the HF checkpoint it came from, at other layouts than the conversion's.

Run as `torchrun --nproc-per-node 2 tests/mp/init_checkpoint_worker.py HF_DIR MCORE_DIR OUT_JSON`;
rank 0 writes, per layout, the max |Δ log-prob| of the trainable actor and of a frozen reference, and
(a control) against the unloaded random initialisation.
"""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from layouts_worker import LAYOUTS, make_batch  # noqa: E402

from megatron_rl.config.schema import ModelConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.model_config import init_checkpoint, read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.train.policy import load_init  # noqa: E402
from tests.mp.common import finish  # noqa: E402


def logprobs(hf: dict, layout, path: str | None, trainable: bool) -> torch.Tensor:  # noqa: ANN001
    recipe = build_model(hf, layout, torch.float32)
    actor = Actor(recipe, 2, Training(TrainerConfig(lr=1e-3), layout, 10) if trainable else None)
    if path is not None:                                 # None: the random initialisation (a control)
        load_init(actor, path, weight_map(hf))
    return actor.compute_logprobs(make_batch(hf["vocab_size"]), temperature=1.0)


def main() -> None:

    hf_dir, mcore_dir, out = sys.argv[1:4]
    init = init_checkpoint(ModelConfig(init_checkpoint=mcore_dir))
    hf = read_hf_config(init.hf_dir)                     # the config the conversion recorded
    result = {"megatron": init.megatron, "server_args": init.server_args}
    for name in ("tp1", "tp2_sp", "ep2"):
        init_parallel(LAYOUTS[name], seed=1234)
        for trainable in (True, False):
            a = logprobs(hf, LAYOUTS[name], hf_dir, trainable)
            b = logprobs(hf, LAYOUTS[name], mcore_dir, trainable)
            result[f"{name}/{'actor' if trainable else 'reference'}"] = float((a - b).abs().max())
        result[f"{name}/vs_random_init"] = float((a - logprobs(hf, LAYOUTS[name], None, False)).abs().max())
    finish(result, out)


if __name__ == "__main__":
    main()
