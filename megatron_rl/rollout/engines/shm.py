"""The CPU/shared-directory backend of vLLM's weight-transfer engine (`mrl_shm`).

The trainer drives every sync through vLLM's own weight-transfer routes (/init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update), the same calls as for the `nccl`
and `ipc` backends on GPU. Tensors cannot cross HTTP, so `/update_weights` carries a manifest:
segment files (in /dev/shm, or a directory every node sees) and, per tensor, its HF name, dtype,
shape, segment and offset (`sync/shm.py` writes them, once for all servers). Each
worker maps the segments (kept mapped while a file stays the same) and loads views into them.

Loading is vLLM's layer-wise reload, as its own checkpoint-format engines do: each layer is
re-processed (`process_weights_after_loading`, CPU GEMM re-packing included) and copied into the
existing kernel tensors; then the CPU fused-MoE experts are re-packed, which vLLM 0.32 skips on a
weight update. (Loading straight into the live parameters is not an option on CPU: vLLM re-packs
every CPU linear weight into a oneDNN handle and empties the parameter.)

Registered by the worker extension's import (`engines.register`, before the model loads); the
server runs with `--weight-transfer-config '{"backend":"mrl_shm"}'`.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import MOE_LOAD, MOE_LOADS
from .digest import loads_recorded
from .loaded import LOADED, repack_cpu_moe, views


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    moe_load: str = MOE_LOAD
    """CPU fused-MoE experts: through the layer-wise reload like every layer ('layerwise'), or
    copied by their weight loaders straight into the live (packed) expert tensors and re-packed
    once at the end ('in_place': two passes over the expert bytes instead of four). GPU workers
    always use the layer-wise reload."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    version: int
    segments: list[list[Any]]
    """[path, size] per segment file."""
    tensors: list[list[Any]] = field(default_factory=list)
    """[hf_name, dtype, shape, segment, offset] per tensor."""


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moe_load = MOE_LOAD
        self.maps: dict[tuple[str, int, int], tuple[mmap.mmap, torch.Tensor]] = {}
        self.round: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        if init_info.moe_load not in MOE_LOADS:
            raise ValueError(f"mrl_shm: init_info.moe_load must be one of {MOE_LOADS}, got {init_info.moe_load!r}")
        self.moe_load = init_info.moe_load
        self.maps.clear()

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        if self.moe_load == "in_place" and self.device.type == "cpu":
            _experts_out_of_reload(self.model)
        self.round = {"version": None, "tensors": 0, "names": []}

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        segments = self._map(update_info.segments)
        with disable_mtp_completeness_check(), loads_recorded(self.model):
            cast(Any, self.model).load_weights(views(update_info.tensors, segments))
        self.round["version"] = int(update_info.version)
        self.round["tensors"] += len(update_info.tensors)
        self.round["names"] += [t[0] for t in update_info.tensors]

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if not self.round.get("tensors"):
            return      # every layer kept its packed tensors: packing them again would corrupt them
        repacked = repack_cpu_moe(self.model, self.round["names"])
        LOADED.update(version=self.round["version"], tensors=self.round["tensors"], moe_layers_repacked=repacked)

    def shutdown(self) -> None:
        self.maps.clear()

    def _map(self, segments: list[list[Any]]) -> list[torch.Tensor]:
        """Each (path, size) as a uint8 tensor over a shared mapping; mappings of files not in this
        manifest are dropped (a new directory per update on shared file systems)."""
        keys = []
        for path, size in segments:
            key = (str(path), os.stat(path).st_ino, int(size))
            if key not in self.maps:
                with open(path, "r+b") as f:
                    mapped = mmap.mmap(f.fileno(), int(size))
                self.maps[key] = (mapped, torch.frombuffer(mapped, dtype=torch.uint8))
            keys.append(key)
        for key in set(self.maps) - set(keys):
            del self.maps[key]      # unmapped once vLLM holds no view into it either
        return [self.maps[k][1] for k in keys]


def _experts_out_of_reload(model: torch.nn.Module) -> int:
    """Put the live expert tensors of every CPU fused-MoE layer back in place of the layer-wise
    reload's placeholders, so `load_weights` copies the experts straight into them (their
    loaders narrow and copy, the layout is the checkpoint's until `repack_cpu_moe` packs it).
    Uses vLLM 0.32's own helper for a layer that received nothing (`_place_kernel_tensors`)."""
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if getattr(kernel, "fused_experts", None) is None:
            continue
        info = get_layerwise_info(module)
        if info.can_load():
            _place_kernel_tensors(module, info)
            info.reset()
            count += 1
    return count
