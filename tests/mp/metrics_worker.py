"""torchrun worker: only rank 0 writes metrics (jsonl, TensorBoard, W&B), and W&B gets the
resolved recipe. A stand-in `wandb` module records `init` calls per rank (W&B cannot run offline
here); everything else is the trainer's own code, on a real 2-process gloo world.

`torchrun --nproc-per-node 2 tests/mp/metrics_worker.py RECIPE RUN_DIR OUT_JSON`
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch.distributed as dist

from megatron_rl.megatron import cpu_compat

cpu_compat.apply()   # explicit: the trainer's modules import megatron-core

from megatron_rl.config.loader import load_recipe, to_dict  # noqa: E402
from megatron_rl.megatron.devices import backend, init_distributed  # noqa: E402
from megatron_rl.train.metrics import open_metrics_log  # noqa: E402
from tests.mp.common import finish  # noqa: E402


def main() -> None:
    recipe, run_dir, out = sys.argv[1:4]
    init_distributed()
    rank = dist.get_rank()
    calls: list[dict] = []
    sys.modules["wandb"] = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or _Run())
    cfg = load_recipe(recipe, ["logging.wandb_project=p", "logging.tensorboard=true"])
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    log = open_metrics_log(cfg, run, 0)
    for step in (1, 2):
        if log is not None:
            log.log(step, {"reward/mean": float(step), "rank": float(rank)})
    if log is not None:
        log.close()
    report = [{"rank": rank, "has_log": log is not None, "wandb_inits": len(calls),
               "wandb_config_is_resolved_recipe": bool(calls) and calls[0]["config"] == to_dict(cfg)}]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report[0])
    result = None
    if rank == 0:
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        result = {"ranks": gathered, "lines": lines, "backend": backend(), "world_backend": dist.get_backend(),
                  "tensorboard_files": len(list((run / "tensorboard").glob("*")))}
    finish(result, out)


class _Run:
    def log(self, metrics: dict, step: int) -> None:
        pass


if __name__ == "__main__":
    main()
