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

A delta round (`sync/delta.py`) also names patches in checkpoint coordinates (HF name, flat
indices, values) in patch files beside the segments, which hold the previous version. They are
applied through vLLM 0.32's own patch loader (`load_checkpoint_weight_patches`: NaN-staged,
masked final copy, validated indices): on a GPU worker into the live weights, in place and without
the layer-wise reload (that loader's contract, as vLLM's `sparse_nccl` engine does); on a CPU
worker into a host copy of the checkpoint tensor, which the layer-wise reload then loads like a
dense update, because vLLM re-packs every CPU linear weight into a oneDNN (or sgl) handle and
leaves the parameter empty (`vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm`,
`remove_weight`), so there is nothing in place to patch. On CPU a delta round therefore costs
at least a dense one on the server (every changed tensor is reloaded whole, and at 2 % of the
elements changed uniformly every tensor is), plus the patch staging (`PHASES`; bench/sync_bench.py
--delta prints them): it saves the trainer's writes and the bytes, not the server's load.

Registered by the worker extension's import (`engines.register`, before the model loads); the
server runs with `--weight-transfer-config '{"backend":"mrl_shm"}'`.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterable, Iterator
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
    patch_segments: list[list[Any]] = field(default_factory=list)
    """A delta round's patch files, [path, size] each."""
    patches: list[list[Any]] = field(default_factory=list)
    """A delta round's patches, [hf_name, dtype, shape, index dtype (None: whole), count, [file,
    offset] of the indices, [file, offset] of the values] (`sync/delta.PatchEntry`); `tensors` are
    then the previous version."""


PHASES = ("map_s", "patch_s", "load_s", "finalize_s", "repack_s")
"""A round's time on a worker by phase (`LOADED["seconds"]`, read by `bench/sync_bench.py --delta`):
mapping the files; staging the patches through vLLM's patch loader (CPU: into host copies);
`load_weights` (the layer-wise reload, the patch staging not counted; GPU delta: the in-place
patches); `finalize_layerwise_reload` (each layer re-processed and copied into its kernel tensors);
re-packing the CPU fused-MoE experts (ours: vLLM 0.32 skips it on an update)."""


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moe_load = MOE_LOAD
        self.maps: dict[tuple[str, int, int], tuple[mmap.mmap, torch.Tensor]] = {}
        self.round: dict[str, Any] = {}
        self.reloading = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        if init_info.moe_load not in MOE_LOADS:
            raise ValueError(f"mrl_shm: init_info.moe_load must be one of {MOE_LOADS}, got {init_info.moe_load!r}")
        self.moe_load = init_info.moe_load
        self.maps.clear()

    def start_weight_update(self) -> None:
        self.reloading = False
        self.round = {"version": None, "tensors": 0, "names": [], "patched": 0, "seconds": dict.fromkeys(PHASES, 0.0)}

    def _reload(self) -> None:
        """Enter vLLM's layer-wise reload (once per round; not for a GPU delta, applied in place)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.reloading:
            return
        initialize_layerwise_reload(self.model)
        if self.moe_load == "in_place" and self.device.type == "cpu":
            _experts_out_of_reload(self.model)
        self.reloading = True

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        seconds = self.round["seconds"]
        start = time.perf_counter()
        mapped = self._map(update_info.segments + update_info.patch_segments)
        segments, patch_files = mapped[:len(update_info.segments)], mapped[len(update_info.segments):]
        patches = [checkpoint_patch(row, patch_files) for row in update_info.patches]
        seconds["map_s"] += time.perf_counter() - start
        start, staged = time.perf_counter(), seconds["patch_s"]
        with disable_mtp_completeness_check(), loads_recorded(self.model):
            if patches and self.device.type == "cuda":
                patch_in_place(self.model, patches, self.device)
            else:
                self._reload()
                weights = views(update_info.tensors, segments)
                cast(Any, self.model).load_weights(patched(weights, patches, seconds) if patches else weights)
        seconds["load_s"] += time.perf_counter() - start - (seconds["patch_s"] - staged)
        self.round["version"] = int(update_info.version)
        self.round["tensors"] += len(update_info.tensors)
        self.round["names"] += [t[0] for t in update_info.tensors]
        self.round["patched"] += len(patches)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        seconds = self.round.get("seconds", dict.fromkeys(PHASES, 0.0))
        start = time.perf_counter()
        if self.reloading:
            finalize_layerwise_reload(self.model, self.model_config)
        seconds["finalize_s"] = time.perf_counter() - start
        if not self.round.get("tensors"):
            return      # every layer kept its packed tensors: packing them again would corrupt them
        start = time.perf_counter()
        repacked = repack_cpu_moe(self.model, self.round["names"]) if self.reloading else 0
        seconds["repack_s"] = time.perf_counter() - start
        LOADED.update(version=self.round["version"], tensors=self.round["tensors"], moe_layers_repacked=repacked,
                      seconds=dict(seconds))
        if self.round["patched"]:
            LOADED["patched"] = self.round["patched"]
        else:
            LOADED.pop("patched", None)

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


def checkpoint_patch(row: list[Any], files: list[torch.Tensor]) -> Any:
    """A manifest patch row (`sync/delta.PatchEntry`) as vLLM's `CheckpointWeightPatch`, its
    indices and values views into the mapped patch files."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    name, dtype, shape, index_dtype, count, (iseg, ioff), (vseg, voff) = row
    dt = getattr(torch, dtype)
    values = files[vseg][voff:voff + count * dt.itemsize].view(dt)
    indices = None
    if index_dtype is not None:
        it = getattr(torch, index_dtype)
        indices = files[iseg][ioff:ioff + count * it.itemsize].view(it)
    return CheckpointWeightPatch(name=name, shape=tuple(shape), dtype=dt, values=values, indices=indices)


PATCH_CHUNK_BYTES = 256 << 20
"""Patch bytes moved to a GPU worker's device at a time (a delta of Qwen3-235B is ~60 GB)."""


def patch_in_place(model: torch.nn.Module, patches: list[Any], device: torch.device) -> None:
    """GPU worker: the patches into the live weights through vLLM's patch loader, in place, whole
    tensors and sparse ones in separate calls (the loader takes one kind per call), moved to
    `device` first so that its NaN staging and masked copies run there."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    for whole in (True, False):
        group = [p for p in patches if (p.indices is None) == whole]
        while group:
            chunk: list[Any] = []
            size = 0
            while group and (not chunk or size + group[0].values.nbytes <= PATCH_CHUNK_BYTES):
                p = group.pop(0)
                size += p.values.nbytes + (p.indices.nbytes if p.indices is not None else 0)
                chunk.append(p._replace(values=p.values.to(device),
                                        indices=None if p.indices is None else p.indices.to(device)))
            load_checkpoint_weight_patches(model, chunk)


class _CheckpointTensors(torch.nn.Module):
    """Host tensors in checkpoint coordinates as vLLM's patch loader sees a model: `load_weights`
    copies each tensor it is given into the held one of that name (through the loader's masked
    `copy_`, which keeps the elements a patch leaves unchanged)."""

    def __init__(self, held: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.held = held

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, t in weights:
            self.held[name].copy_(t)
        return set(self.held)


def patched(weights: Iterator[tuple[str, torch.Tensor]], patches: list[Any],
            seconds: dict[str, float] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """CPU worker: every tensor of the previous version (`weights`), those with a patch as a copy
    with the patch applied by vLLM's patch loader; a whole patch as its values. The time spent
    staging the patches is added to `seconds["patch_s"]`."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    by_name = {p.name: p for p in patches}
    for name, base in weights:
        p = by_name.pop(name, None)
        if p is None:
            yield name, base
        elif p.indices is None:
            yield name, p.values.view(p.shape)
        else:
            start = time.perf_counter()
            held = {name: base.clone()}
            load_checkpoint_weight_patches(_CheckpointTensors(held), [p])
            if seconds is not None:
                seconds["patch_s"] = seconds.get("patch_s", 0.0) + time.perf_counter() - start
            yield name, held[name]
    if by_name:
        raise ValueError(f"mrl_shm: patches for tensors the update does not hold: {sorted(by_name)[:5]}")


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
