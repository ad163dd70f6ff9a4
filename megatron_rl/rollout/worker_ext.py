"""vLLM worker extension (`--worker-extension-cls`): receive weights from the trainer.

Methods are called through the server's `/collective_rpc` with string arguments only. The CPU
transport hands over safetensors files (buckets) in a shared-memory directory; `finish` reloads
them through vLLM's layer-wise reload and then re-runs the CPU MoE expert repacking, which vLLM
0.32 skips on a weight update (the weights would silently stay in the old packed layout).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch


class WorkerExtension:
    """Mixed into vLLM's worker; `self.model_runner` is the worker's model runner."""

    _mrl_buckets: list[str]
    _mrl_version: int = 0

    def mrl_begin_update(self, version: str) -> int:
        self._mrl_buckets = []
        self._mrl_pending_version = int(version)
        return self._mrl_pending_version

    def mrl_add_bucket(self, path: str) -> int:
        self._mrl_buckets.append(path)
        return len(self._mrl_buckets)

    def mrl_finish_update(self, expected_names: str) -> dict[str, Any]:
        """Reload every bucket received since `mrl_begin_update`; returns what was loaded."""
        names = self._iter_names()
        expected = set(json.loads(expected_names))
        if names != expected:
            missing, extra = sorted(expected - names)[:10], sorted(names - expected)[:10]
            raise RuntimeError(f"weight update incomplete: missing {missing}, unexpected {extra}")
        self.model_runner.reload_weights(weights_iterator=self._iter_tensors(), is_checkpoint_format=True)
        repacked = _repack_cpu_moe(self.model_runner.get_model())
        self._mrl_version = self._mrl_pending_version
        return {"version": self._mrl_version, "tensors": len(names), "moe_layers_repacked": repacked}

    def mrl_weight_version(self) -> int:
        return self._mrl_version

    def mrl_reseed(self, seed: str) -> int:
        """Re-seed the worker's sampling RNG (unseeded requests draw from it). With one request in
        flight at a time, a step's samples then depend only on (seed, weights, prompts)."""
        torch.manual_seed(int(seed))
        return int(seed)

    def _iter_names(self) -> set[str]:
        from safetensors import safe_open

        names: set[str] = set()
        for path in self._mrl_buckets:
            with safe_open(path, "pt") as f:
                names.update(f.keys())
        return names

    def _iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for path in self._mrl_buckets:
            with safe_open(path, "pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)


def _repack_cpu_moe(model: torch.nn.Module) -> int:
    """Re-run the CPU grouped-GEMM repacking of every fused-MoE layer after new weights landed."""
    if torch.cuda.is_available():
        return 0
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)
            count += 1
    return count
