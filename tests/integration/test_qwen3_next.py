"""Qwen3-Next (hybrid Gated DeltaNet + gated attention, MoE with shared expert) in Megatron on CPU.

Megatron runs in subprocesses: cpu_compat patches torch.cuda for the whole process.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.mp.launch import torchrun

# Logits are O(1) (max ≈ 3, std ≈ 0.7 here); fp32 with different reduction orders and two
# implementations of the chunked delta rule (HF solves the triangular system, Megatron substitutes
# forward): measured 6.6e-6 at every layout.
LOGIT_ATOL = 1e-4


# The same two GRPO steps at different layouts. Losses (|loss| ~ 0.01–0.1, crossing zero, hence
# absolute) and gradient norms agree to fp32 reduction-order noise (measured ≤ 3.5e-7 and ≤ 3.5e-6
# relative, both in step 2 at TP2+SP; step 1's grad norms agree to 4e-8). Per-tensor gradients of the
# first step: within 1e-4 of each tensor's largest entry (measured ≤ 2e-5 at TP2+SP) — a missing
# TP all-reduce or a mis-split fused tensor is off by O(1). Weights after two Adam steps (lr 1e-3):
# Adam turns round-off in gradients near its eps (1e-8) into up to ±lr per weight per step
# (measured 8e-5 in GDN's in_proj at TP2); a wrong shard moves weights by a whole step.
LOSS_ATOL = 1e-6


GRAD_NORM_RTOL = 1e-5


GRAD_RTOL = 1e-4


WEIGHT_ATOL = 2e-4


def _run(tiny: tuple[Path, Path], out: Path, *layouts: str, nproc: int) -> dict[str, Any]:
    out.mkdir()
    torchrun("qwen3_next_worker.py", str(tiny[0]), str(tiny[1]), str(out), *layouts, nproc=nproc)
    result = json.loads((out / "result.json").read_text())
    for name in layouts:
        result[name].update(torch.load(out / f"{name}.pt"))
    return result


@pytest.fixture(scope="module")
def single_process(tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """TP1 in one process: the reference every parallel layout must reproduce."""
    return _run(tiny, tmp_path_factory.mktemp("q3n_tp1") / "out", "tp1", nproc=1)["tp1"]


def _check_against_hf(got: dict[str, Any], name: str) -> None:
    assert got["round_trip"] == {"missing": [], "extra": [], "not_equal": []}, name
    if got["max_logit_diff"] is not None:
        assert got["max_logit_diff"] <= LOGIT_ATOL, (name, got["max_logit_diff"])


def test_single_process_matches_hf_round_trips_and_trains(single_process: dict[str, Any]) -> None:
    _check_against_hf(single_process, "tp1")
    assert single_process["losses"][0] != single_process["losses"][1]     # the first step changed the policy
    assert len(single_process["weights"]) == 69 and len(single_process["grads"]) == 69
    gdn_grads = [g for k, g in single_process["grads"].items() if ".self_attention.in_proj" in k or "A_log" in k]
    assert gdn_grads and all(g.abs().max() > 0 for g in gdn_grads)         # backward reaches the GDN layers


def test_parallel_layouts_match_single_process(tiny: tuple[Path, Path], tmp_path: Path,
                                               single_process: dict[str, Any]) -> None:
    layouts = ("tp2_sp", "ep2", "pp2")          # one torchrun: most of its time is imports
    result = _run(tiny, tmp_path / "out", *layouts, nproc=2)
    ref = single_process
    for name in layouts:
        got = result[name]
        _check_against_hf(got, name)
        assert got["losses"] == pytest.approx(ref["losses"], rel=0, abs=LOSS_ATOL), name
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=GRAD_NORM_RTOL), name
        if got["grads"] is not None:       # layouts without data parallelism: every gradient, per tensor
            for k, g in ref["grads"].items():
                scale = g.abs().max().item()
                assert (got["grads"][k] - g).abs().max().item() <= GRAD_RTOL * scale, (name, k)
        weight_diff = max((got["weights"][k] - w).abs().max().item() for k, w in ref["weights"].items())
        assert weight_diff <= WEIGHT_ATOL, (name, weight_diff)
