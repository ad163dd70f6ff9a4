"""Which device this rank computes on, and the world process group that carries its collectives.

On GPU each rank is bound to `cuda:$LOCAL_RANK` before anything touches CUDA: megatron-core, TE and
NCCL all allocate on the *current* device, so without the binding every rank of a node would
build its model on GPU 0. The world group is `cpu:gloo,cuda:nccl`: CUDA tensors go over NCCL,
while CPU tensors and object collectives go over gloo. That lets small control collectives (the
stop flag, verification statistics) stay on the CPU, and it lets ranks that wait for rank 0
(starting vLLM, generating) block in a gloo call on a CPU tensor instead of spinning an NCCL kernel
on a GPU that a colocated vLLM is using. `dist.barrier()` itself is an NCCL all-reduce once the
group has a bound device (`device_id`): use it only where the wait is short.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..config.schema import TrainerConfig
from . import rendezvous

DEFAULT_COLLECTIVE_TIMEOUT_MIN: float = TrainerConfig.collective_timeout_min
"""The recipe's default, for callers without a recipe (tests, tools)."""


def compute_device() -> torch.device:
    """This rank's device: its bound GPU, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bind_local_device() -> torch.device:
    """Make `cuda:$LOCAL_RANK` current (torchrun sets LOCAL_RANK); the CPU when there is no GPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local >= count:
        raise RuntimeError(f"LOCAL_RANK={local} but only {count} GPU(s) are visible "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): "
                           "start at most one rank per GPU")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def backend() -> str:
    """gloo for CPU tensors always; NCCL for CUDA tensors when there is a GPU."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(timeout_min: float = DEFAULT_COLLECTIVE_TIMEOUT_MIN, store: dist.Store | None = None) -> None:
    """Bind the device, then create the world group (once). The timeout must cover the longest
    time a rank can wait for rank 0: the rollout server's start and a full rollout. `store` is
    for a world of one (rank 0 of 1); otherwise torchrun's rendezvous environment is used, and a
    store this rank hosts (torchrun's agent normally does) listens only on $MASTER_ADDR."""
    if dist.is_initialized():
        return
    device = bind_local_device()
    kwargs: dict = {"device_id": device} if device.type == "cuda" else {}
    if store is not None:
        kwargs.update(store=store, rank=0, world_size=1)
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rendezvous.install(multi_node=world > int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dist.init_process_group(backend(), timeout=timedelta(minutes=timeout_min), **kwargs)


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` (a picklable object) on every rank, over gloo (collective; a process
    without a process group, or alone in it, keeps its own)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wait_for_rank0() -> None:
    """Block until rank 0 arrives, on the CPU (gloo): no NCCL kernel spins meanwhile."""
    flag = torch.zeros(1)
    dist.broadcast(flag, src=0)
