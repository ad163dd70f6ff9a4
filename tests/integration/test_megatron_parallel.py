"""Real megatron-core on CPU (gloo, 2 processes): parallel layouts agree, checkpoints reshard."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.helpers.models import TINY_DENSE
from tests.mp.launch import REPO, torchrun

TINY_FIELDS = yaml.safe_load((REPO / "recipes/tiny/base.yaml").read_text())["model"]["tiny"]
# Losses agree to fp32 reduction-order noise. Weights after 2 Adam steps (lr 1e-3) differ more:
# Adam divides by sqrt(v), so parameters whose gradient is ~0 turn round-off into updates of up
# to ±lr; 1e-4 is 10 % of one step's size, far below what a wrong shard or a lost gradient gives
# (those move weights by a whole step, ~1e-3). The round-off depends on the CPU's kernels: GSPO at
# TP 2 + SP measured 6.5e-5 on one 2-core Xeon host, under the 5e-5 bound on another.
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_checkpoint(TINY_FIELDS, tmp_path_factory.mktemp("tiny_moe"), seed=0)


def test_layouts_give_the_same_grpo_and_gspo_steps(tiny_moe: Path, tmp_path: Path) -> None:
    out = tmp_path / "layouts.json"
    torchrun("layouts_worker.py", str(tiny_moe), str(out))
    result = json.loads(out.read_text())
    for objective in ("grpo", "gspo"):
        ref = result[f"{objective}/tp1"]
        assert ref["num_tensors"] == 33 and len(ref["losses"]) == 2
        assert ref["losses"][0] != ref["losses"][1]          # the first step changed the policy
        for layout in ("tp2_sp", "ep2", "pp2", "tp2_ep2_etp1", "tp2_sp_unfused"):   # the last: the logits path
            got = result[f"{objective}/{layout}"]
            assert got["missing"] == []
            assert got["chunked_same"] and got["parts"][1] > got["parts"][0], (objective, layout, got["parts"])
            assert got["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL), (objective, layout)
            assert got["max_weight_diff"] <= WEIGHT_ATOL, (objective, layout, got["max_weight_diff"])
            assert got["weight_change"] > 1.5e-3    # two Adam steps of lr 1e-3 really moved the weights


def test_checkpoint_saved_at_one_layout_loads_at_others(tiny_moe: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt.json"
    torchrun("checkpoint_worker.py", str(tiny_moe), str(tmp_path / "ckpt"), str(out))
    saved = json.loads(out.read_text())
    assert saved["spawned_by_save"] == []       # megatron's write results kept in process, no manager
    result = saved["layouts"]
    assert set(result) == {"tp1", "tp2_sp", "ep2", "pp2", "tp2_ep2_etp1"}
    for layout, got in result.items():
        assert got["max_logprob_diff"] <= 2e-6, layout          # identical weights, fp32 noise only
        assert got["step"] == 1 and got["extra"] == {"epoch": 3}
        if got["optimizer_loaded"]:
            # Optimizer state, step count and LR schedule restored: the next step matches the saver's.
            assert got["logprob_diff_after_step"] <= 2e-6, layout
    # Layouts whose dense/expert optimizer split matches the saver's restore the optimizer too.
    assert result["tp2_sp"]["optimizer_loaded"] and result["tp1"]["optimizer_loaded"]
    assert not result["ep2"]["optimizer_loaded"]               # reported, weights still loaded


def test_non_finite_loss_or_gradient_skips_the_update(tiny_moe: Path, tmp_path: Path) -> None:
    out = tmp_path / "nan.json"
    torchrun("nan_worker.py", str(tiny_moe), str(out))
    r = json.loads(out.read_text())
    assert r["bad_skipped"] == 1.0 and not r["bad_loss_finite"]
    assert r["weights_unchanged_after_bad"]                # NaN never reached the weights
    assert r["good_skipped"] == 0.0 and r["weights_changed_after_good"]
    # A NaN gradient with a finite loss (poisoned on one rank): the norm is checked after the
    # gradients are prepared, every rank skips, and the weights stay as they were.
    assert math.isfinite(r["grad_loss"]) and not math.isfinite(r["grad_norm_poisoned"])
    assert r["grad_skipped_on_all_ranks"] == 1.0 and r["weights_unchanged_after_bad_grad"]
    assert math.isfinite(r["good_grad_norm"]) and r["good_grad_norm"] > 0


@pytest.mark.parametrize("kind", ["moe", "dense", "next"])
def test_budget_microbatches_equal_the_padded_path(kind: str, tiny_moe: Path, tmp_path: Path) -> None:
    """Token-budget micro-batches (length groups cut to their longest row, a different count per
    step) give the padded path's log-probs, losses and reduced gradients at every layout, with
    CHORD's expert rows riding along, and through Qwen3-Next's Gated DeltaNet layers (causal, so
    the pads after a row never reach it). Same tolerances as across layouts: fp32 reduction order only
    (measured: log-probs 1e-6, gradients 5e-8 on a largest entry of 8e-2)."""
    from tests.helpers.models import TINY_QWEN3_NEXT

    fields = {"dense": TINY_DENSE, "next": TINY_QWEN3_NEXT}.get(kind)
    hf_dir = tiny_moe if fields is None else build_tiny_hf_checkpoint(fields, tmp_path / kind, seed=0)
    out = tmp_path / "budget.json"
    torchrun("budget_worker.py", str(hf_dir), kind, str(out))
    result = json.loads(out.read_text())
    expected = {"tp1/grpo", "tp2_sp/grpo", "pp2/grpo"} | (set() if kind == "next" else {"tp1/chord", "pp2/chord"}) | (
        {"ep2/grpo", "tp2_ep2_etp1/grpo", "tp2_ep2_etp1/chord"} if kind == "moe" else set())
    assert set(result) == expected
    for case, got in result.items():
        padded_widths, budget_widths = got["widths"]
        assert set(padded_widths) == {24} and min(budget_widths) < 24, case       # rows really were cut
        counts = got["budget_microbatch_counts"]
        assert len(set(counts)) == 1, (case, counts)                            # same count on every rank
        assert got["logprob_diff"] <= 2e-6, case
        assert got["odd_rows_diff"] <= 2e-6 and got["odd_rows_shape"] == [7, 23], case
        assert got["losses"][1] == pytest.approx(got["losses"][0], rel=LOSS_RTOL), case
        assert got["grad_norms"][1] == pytest.approx(got["grad_norms"][0], rel=LOSS_RTOL), case
        assert got["metric_keys_same"], case
        assert got["grad_diff"] <= 1e-5 * got["grad_scale"] and got["grad_scale"] > 1e-3, case
        assert got["weight_diff"] <= WEIGHT_ATOL, case
    # CHORD's expert rows need room: the budget path forms more micro-batches than the padded one.
    assert any(got["microbatches"][1] != got["microbatches"][0] for got in result.values())
