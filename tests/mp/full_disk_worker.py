"""World-of-one worker: save a checkpoint where it fits, then one onto a nearly full file system.

`python tests/mp/full_disk_worker.py HF_DIR ROOMY_DIR FULL_DIR OUT_JSON`: FULL_DIR is a small
tmpfs (mounted by the test); the second save must fail with one `DiskFullError` naming the path
and the bytes needed, leave no `.partial`, and leave what was already there intact.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.config.schema import AlgorithmConfig, ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.megatron.checkpoint import DiskFullError, latest_checkpoint, save_checkpoint  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model  # noqa: E402
from megatron_rl.train.run import init_process_group  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from layouts_worker import make_batch  # noqa: E402


def main() -> None:
    hf_dir, roomy, full, out = sys.argv[1:5]
    init_process_group()
    init_parallel(ParallelismConfig(), seed=1)
    actor = Actor(build_model(read_hf_config(hf_dir), ParallelismConfig(), torch.float32),
                  2, Training(TrainerConfig(lr=1e-3), ParallelismConfig(), total_updates=10))
    batch = make_batch(read_hf_config(hf_dir)["vocab_size"])     # one step: the optimizer has state
    batch.old_logprobs = actor.compute_logprobs(batch, temperature=1.0)
    actor.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=0)
    saved = save_checkpoint(actor, Path(roomy) / "step_00000001", {"step": 1})
    result = {"roomy_latest": str(latest_checkpoint(roomy)), "roomy_saved": str(saved)}
    try:
        save_checkpoint(actor, Path(full) / "step_00000002", {"step": 2})
        result["error"] = None
    except DiskFullError as exc:
        result["error"] = str(exc)
    result["full_dir_after"] = sorted(p.name for p in Path(full).iterdir())
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
