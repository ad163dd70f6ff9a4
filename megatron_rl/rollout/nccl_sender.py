"""The trainer's end of vLLM's `nccl` weight-transfer engine (vLLM's own helpers; used by
sync/gpu.py, which keeps vLLM imports in rollout/)."""

from __future__ import annotations

from typing import Any

import torch

PACKED_BUFFER_BYTES = 1 << 30
"""vLLM's default packed-buffer geometry; the workers get the same in their init info."""
PACKED_BUFFERS = 2


def open_group(address: str, port: int, world_size: int, device: torch.device) -> Any:
    """Rank 0 of the NCCL group the servers' workers join (PyNcclCommunicator on `device`)."""
    return open_member(address, port, 0, world_size, device)


def nccl_unusable() -> str | None:
    """Why vLLM's PyNcclCommunicator would come up disabled in this process (every collective then
    a silent no-op), or None: the checks of its constructor (`pynccl.py`), before any member joins."""
    import vllm.envs as envs
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    if envs.VLLM_DISABLE_PYNCCL:
        return "VLLM_DISABLE_PYNCCL is set"
    try:
        NCCLLibrary()
    except Exception as e:   # what vLLM's constructor catches: the library did not load
        return f"libnccl did not load ({type(e).__name__}: {e})"
    return None


def open_member(address: str, port: int, rank: int, world_size: int, device: torch.device) -> Any:
    """Member `rank` of a stateless NCCL group (vLLM's PyNcclCommunicator on the CUDA `device`;
    rank 0 hosts its store at `address:port`): the servers' weight-transfer group, or the rollout
    nodes' receivers' (`sync/network.py`)."""
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

    with torch.cuda.device(device):
        comm = stateless_init_process_group(address, port, rank, world_size, device)
    if comm.disabled:       # no NCCL library, or VLLM_DISABLE_PYNCCL: every collective a silent no-op
        raise RuntimeError(f"NCCL group member {rank}/{world_size} on {device}: vLLM's PyNcclCommunicator is "
                           "disabled (libnccl not found, or VLLM_DISABLE_PYNCCL set): a broadcast would send nothing")
    return comm


def broadcast(comm: Any, tensors: dict[str, torch.Tensor], device: torch.device, packed: bool) -> None:
    """Send `tensors` (contiguous, on `device`) in order to every worker, as the engine's consumer
    expects them (packed into buffers of the geometry above, or one by one)."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        if packed:
            # The producer packs (torch.cat) on side streams of its own without waiting for this
            # one, where the tensors were just written (the gather's recv/cat, the .to/.contiguous
            # copies; a sync collective's wait() orders only the current stream): finish them first.
            stream.synchronize()
            packed_nccl_broadcast_producer(iter(tensors.items()), comm, 0, lambda item: item[1],
                                           PACKED_BUFFER_BYTES, PACKED_BUFFERS)
            return
        for t in tensors.values():
            comm.broadcast(t, src=0, stream=stream)
        stream.synchronize()


def broadcast_patches(comm: Any, patches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
    """Send a sparse round's (int32 indices, values) per tensor (contiguous, on `device`) in order,
    indices first: what vLLM's sparse receive (`SparseNCCLWeightTransferEngine.receive_weights`)
    posts on every worker, one broadcast each, never packed."""
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        # The patches were just written on this stream (the gather, the .to copies); NCCL's
        # broadcast is enqueued on the same stream, so no wait is needed before it.
        for indices, values in patches:
            comm.broadcast(indices, src=0, stream=stream)
            comm.broadcast(values, src=0, stream=stream)
        stream.synchronize()
