"""What a vLLM worker loaded, and the pieces every engine loads with (no vLLM imports here).

`LOADED` is this worker process's record of its last update (one worker per process): the engines
write it, `WorkerExtension.mrl_check_loaded` / `mrl_loaded` / `mrl_weight_version` check and report it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import torch

LOADED: dict[str, Any] = {"version": 0}
"""What this worker process last loaded: version (None: finished, not yet committed), tensors,
MoE layers re-packed."""


def check_loaded(record: dict[str, Any], expected: str, where: str) -> dict[str, Any]:
    """`record` (a worker's `LOADED`) if it holds the fields of `expected` (JSON, from the trainer)
    with the same values; otherwise RuntimeError naming `where` (which DP engine and worker)."""
    want = json.loads(expected)
    got = {key: record.get(key) for key in want}
    if got != want:
        raise RuntimeError(f"weight update check failed on {where}: loaded {got}, the trainer sent {want}")
    return dict(record)


def views(tensors: list[list[Any]], segments: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each manifest entry [name, dtype, shape, segment, offset] as a view into its segment's bytes."""
    for name, dtype, shape, segment, offset in tensors:
        dt = getattr(torch, dtype)
        n = math.prod(shape) * dt.itemsize
        yield name, segments[segment][offset:offset + n].view(dt).view(shape)


def repack_cpu_moe(model: torch.nn.Module, names: list[str]) -> int:
    """Re-run the CPU grouped-GEMM repacking of every fused-MoE layer whose weights landed, which
    vLLM 0.32 skips on a weight update (the weights would silently stay in the old packed layout).
    A layer the update left out (LoRA syncs only attention) keeps its packed tensors: packing them
    again would scramble them."""
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
