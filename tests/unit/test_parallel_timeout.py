"""Megatron's process groups wait as long as the recipe's world group (trainer.collective_timeout_min),
not megatron-core's default 30 minutes (gpu-readiness-audit-2 #20): a world of one on gloo."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rl.megatron import cpu_compat

cpu_compat.apply()

from megatron.core import parallel_state as ps  # noqa: E402

from megatron_rl.config.schema import ParallelismConfig  # noqa: E402
from megatron_rl.megatron.actor import init_parallel  # noqa: E402
from megatron_rl.megatron.devices import init_distributed  # noqa: E402


def test_megatron_groups_take_the_recipe_timeout() -> None:
    init_distributed(store=dist.HashStore())
    try:
        init_parallel(ParallelismConfig(), seed=1, timeout_min=7.5)
        groups = {"tp": ps.get_tensor_model_parallel_group(), "dp": ps.get_data_parallel_group(),
                  "ep": ps.get_expert_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group()}
        for name, group in groups.items():
            timeout = group._get_backend(torch.device("cpu")).options._timeout
            assert timeout == timedelta(minutes=8), (name, timeout)     # whole minutes, rounded up
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
