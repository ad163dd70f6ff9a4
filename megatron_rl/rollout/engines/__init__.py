"""The vLLM side of weight sync: one weight-transfer engine per `rollout.weight_transfer` backend.

The server runs with `--weight-transfer-config '{"backend": <engine>}'` (`RolloutServer.command`);
every vLLM worker imports the worker extension (`--worker-extension-cls`) before its model loads,
and that import registers the engines below with vLLM's factory (`register`). Engine modules
import vLLM and are loaded by the factory only when a server uses them; this module does not, so
the trainer can read the table. The trainer's side of each backend is in `megatron_rl/sync/`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Engine:
    name: str
    """The name vLLM's factory knows it by (`--weight-transfer-config`'s backend)."""
    module: str
    cls: str


ENGINES = {
    "shm": Engine("mrl_shm", "megatron_rl.rollout.engines.shm", "ShmWeightTransferEngine"),
    "nccl": Engine("mrl_nccl", "megatron_rl.rollout.engines.gpu", "CountingNcclEngine"),
    "ipc": Engine("mrl_ipc", "megatron_rl.rollout.engines.gpu", "CountingIpcEngine"),
}
"""`rollout.weight_transfer` → its engine. `mrl_nccl` and `mrl_ipc` are vLLM's nccl and ipc
engines that also count what each worker loaded (`gpu.py`)."""

MOE_LOADS = ("layerwise", "in_place")
MOE_LOAD = "in_place"
"""How CPU workers load fused-MoE experts (`shm.ShmInitInfo.moe_load`; GPU workers always reload
layer-wise). In place: steady sync of the 491 MB bench MoE 0.48 s vs 0.53 s layer-wise, server load
0.30 s vs 0.34 s (bench/sync_bench.py --moe-load, one shared 2-core VM)."""


def register() -> None:
    """Make every engine known to vLLM's factory by name (lazily: the factory imports its module)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for engine in ENGINES.values():
        if engine.name not in WeightTransferEngineFactory._registry:      # imported twice in one process
            WeightTransferEngineFactory.register_engine(engine.name, engine.module, engine.cls)
