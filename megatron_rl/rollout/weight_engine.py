"""The CPU/shared-directory backend of vLLM's weight-transfer engine (`mrl_shm`).

The trainer drives every sync through vLLM's own weight-transfer routes (/init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update), the same calls as for the `nccl`
and `ipc` backends on GPU. Tensors cannot cross HTTP, so `/update_weights` carries a manifest:
segment files (in /dev/shm, or a directory every node sees) and, per tensor, its HF name, dtype,
shape, segment and offset (`weights/transport_file.py` writes them, once for all servers). Each
worker maps the segments (kept mapped while a file stays the same) and loads views into them.

Loading is vLLM's layer-wise reload, as its own checkpoint-format engines do: each layer is
re-processed (`process_weights_after_loading`, CPU GEMM re-packing included) and copied into the
existing kernel tensors; then the CPU fused-MoE experts are re-packed, which vLLM 0.32 skips on a
weight update. (Loading straight into the live parameters is not an option on CPU: vLLM re-packs
every CPU linear weight into a oneDNN handle and empties the parameter.)

Registered from `worker_ext` (the module `--worker-extension-cls` names, imported in every worker
before the model loads); the server runs with `--weight-transfer-config '{"backend":"mrl_shm"}'`.
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

from .worker_ext import LOADED, _repack_cpu_moe, _views

MOE_LOADS = ("layerwise", "in_place")


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    moe_load: str = "layerwise"
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
        self.moe_load = "layerwise"
        self.maps: dict[tuple[str, int, int], tuple[mmap.mmap, torch.Tensor]] = {}
        self.round: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        if init_info.moe_load not in MOE_LOADS:
            raise ValueError(f"mrl_shm: init_info.moe_load must be one of {MOE_LOADS}, got {init_info.moe_load!r}")
        self.moe_load = init_info.moe_load
        self.maps.clear()

    def start_weight_update(self) -> None:
        _profile("start")
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        if self.moe_load == "in_place" and self.device.type == "cpu":
            _experts_out_of_reload(self.model)
        self.round = {"version": None, "tensors": 0, "names": []}
        _profile("start_done")

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        _profile("update")
        segments = self._map(update_info.segments)
        with disable_mtp_completeness_check():
            cast(Any, self.model).load_weights(_views(update_info.tensors, segments))
        self.round["version"] = int(update_info.version)
        self.round["tensors"] += len(update_info.tensors)
        self.round["names"] += [t[0] for t in update_info.tensors]
        _profile("update_done")

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        _profile("finish")
        finalize_layerwise_reload(self.model, self.model_config)
        _profile("finalized")
        if not self.round.get("tensors"):
            return      # every layer kept its packed tensors: packing them again would corrupt them
        repacked = _repack_cpu_moe(self.model, self.round["names"])
        _profile("repacked")
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
    loaders narrow and copy, the layout is the checkpoint's until `_repack_cpu_moe` packs it).
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


_SPANS: list[tuple[str, float]] = []


def _profile(mark: str) -> None:
    """MRL_SYNC_PROFILE=<file>: append each sync's phase marks (perf_counter) and, with
    MRL_SYNC_CPROFILE=1, a cProfile of the whole update, to that file (a debugging aid: issue 17's
    sync-speed work found where the server's reload goes with it). Written at "repacked", so
    only for rounds that loaded tensors."""
    out = os.environ.get("MRL_SYNC_PROFILE")
    if not out:
        return
    import time

    if mark == "start":
        _SPANS.clear()
        if "p" in _PROF:
            _PROF.pop("p").disable()        # a round that loaded nothing (no "repacked" mark)
    _SPANS.append((mark, time.perf_counter()))
    prof = _PROF.get("p")
    if mark == "start" and os.environ.get("MRL_SYNC_CPROFILE"):
        import cProfile

        _PROF["p"] = cProfile.Profile()
        _PROF["p"].enable()
    if mark != "repacked":
        return
    t0 = _SPANS[0][1]
    with open(out, "a") as f:
        f.write(" ".join(f"{m}={t - t0:.4f}" for m, t in _SPANS) + "\n")
        if prof is not None:
            import io
            import pstats

            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
            f.write(buf.getvalue())
            _PROF.clear()
    _SPANS.clear()


_PROF: dict[str, Any] = {}
