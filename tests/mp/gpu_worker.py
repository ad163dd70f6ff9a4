"""torchrun worker (GPU): each rank on its own GPU, NCCL control collectives, and one Megatron
actor step with every tensor on the rank's device.

`torchrun --nproc-per-node N tests/mp/gpu_worker.py HF_DIR OUT_DIR` (N = 1 or 2 GPUs) writes
OUT_DIR/<rank>.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.megatron import cpu_compat

cpu_compat.apply()   # explicit (a no-op with CUDA; MEGATRON_RL_REQUIRE_CUDA makes it refuse without)

from megatron_rl.config.schema import AlgorithmConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.train.run import agree_on_stop, init_process_group  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from layouts_worker import LAYOUTS, make_batch  # noqa: E402


def main() -> None:
    hf_dir, out_dir = sys.argv[1:3]
    init_process_group()
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    result: dict[str, object] = {"backend": dist.get_backend(), "local_rank": local,
                                 "current_device": torch.cuda.current_device()}
    # The trainer's per-step control collective: only rank 0 was signalled, every rank must learn it.
    result["stop_seen"] = agree_on_stop("SIGUSR1" if rank == 0 else None) is not None
    hf = read_hf_config(hf_dir)
    layout = LAYOUTS["tp2_sp" if dist.get_world_size() == 2 else "tp1"]
    init_parallel(layout, seed=1)
    actor = Actor(build_model(hf, layout, torch.bfloat16), 2,
                  Training(TrainerConfig(lr=1e-4), layout, total_updates=10))
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    result["param_devices"] = sorted({str(p.device) for p in actor.model.parameters()})
    batch = make_batch(hf["vocab_size"])
    logp = actor.compute_logprobs(batch, 1.0)
    result["logprobs_finite"] = bool(torch.isfinite(logp).all())
    batch.old_logprobs = logp
    metrics = actor.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=0)
    result["step_finite"] = bool(metrics) and all(math.isfinite(float(v)) for v in metrics.values())
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
