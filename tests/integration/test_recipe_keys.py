"""Every recipe key reaches the code or is refused, and the memory keys change what megatron-core
builds (recompute, distributed optimizer, CPU offload, overlap)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.models import _memory_options
from tests.mp.launch import torchrun


def test_memory_options_change_what_megatron_core_builds(tiny_moe: Path, tmp_path: Path) -> None:
    r = _memory_options(tiny_moe, tmp_path / "memory.json", nproc=2)
    built = {name: e["built"] for name, e in r.items()}
    assert built["default"]["recompute"] == [None, None, None]
    assert built["recompute_full"]["recompute"] == ["full", "uniform", 1]
    assert built["recompute_block"]["recompute"] == ["full", "block", 1]
    assert built["recompute_selective"]["recompute"] == ["selective", None, None]
    assert built["default"]["optimizers"] == ["DistributedOptimizer"]
    assert built["default"]["ddp"] == [True, False, False]
    assert built["plain_optimizer"]["optimizers"] == ["FP32Optimizer"] and built["plain_optimizer"]["ddp"][0] is False
    assert built["overlap"]["ddp"] == [True, True, True]
    assert built["cpu_offload_bf16"]["inner_optimizers"] == ["HybridDeviceOptimizer"]
    assert built["cpu_offload_bf16"]["offload_fraction"] == [1.0]
    assert built["default_bf16"]["inner_optimizers"] == ["AdamW"]

    # Activation memory kept for backward falls with recompute (2 layers; block recomputes 1 of
    # them), and the gradients do not change at all (fp32, same kernels re-run).
    mem = {name: r[name]["activation_bytes"] for name in ("default", "recompute_full", "recompute_block",
                                                           "recompute_selective")}
    assert mem["recompute_full"] < 0.2 * mem["default"]
    assert mem["recompute_full"] < mem["recompute_block"] < 0.7 * mem["default"]
    assert mem["recompute_selective"] < mem["default"]
    for name in mem:
        assert r[name]["num_grads"] == 33 and r[name]["max_grad_diff"] <= 1e-7, name

    # The same two GRPO steps under every option: identical losses and final weights (DP 2).
    for name in ("recompute_full", "recompute_block", "recompute_selective", "plain_optimizer", "overlap"):
        assert r[name]["losses"] == pytest.approx(r["default"]["losses"], rel=1e-6), name
        assert r[name]["max_weight_diff"] <= 1e-6, name
    assert r["default"]["losses"][0] != r["default"]["losses"][1]


def test_chord_expert_rows_split_over_dp_only(tiny_moe: Path, tmp_path: Path) -> None:
    """2 expert rows: one per DP rank spread over 4 micro-batches, or 2 over PP 2's 8 micro-batches
    of different sizes; the CHORD losses of two steps agree (global denominators)."""
    out = tmp_path / "chord.json"
    torchrun("chord_split_worker.py", str(tiny_moe), str(out))
    r = json.loads(out.read_text())
    assert r["pp2"] == pytest.approx(r["dp2"], rel=1e-6)
    assert r["dp2"][0] != r["dp2"][1]
