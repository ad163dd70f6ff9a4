"""R3 routing replay on real megatron-core (gloo, 2 processes): the experts the trainer's routers
use are exactly the recorded ones at TP1, TP2/SP+EP2 and PP2, even with a perturbed router."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.mp.launch import REPO, torchrun

TINY_FIELDS = yaml.safe_load((REPO / "recipes/tiny/base.yaml").read_text())["model"]["tiny"]


@pytest.mark.slow
def test_replayed_routes_are_used_exactly_at_every_layout(tmp_path: Path) -> None:
    hf_dir = build_tiny_hf_checkpoint(TINY_FIELDS, tmp_path / "tiny_moe", seed=0)
    out = tmp_path / "replay.json"
    torchrun("routing_replay_worker.py", str(hf_dir), str(out))
    result = json.loads(out.read_text())
    assert result["recorded_experts_used"] == list(range(TINY_FIELDS["num_experts"]))
    for layout in ("tp1", "tp2_sp_ep2", "pp2"):
        got = result[layout]
        total = got["valid_tokens"]
        for mode in ("no_replay", "replay", "train"):
            assert got[mode]["filled_once"], (layout, mode)
        # The perturbed router routes a good share of tokens elsewhere on its own ...
        moved = got["no_replay"]["differ_valid"]
        assert moved > 0.1 * total, (layout, moved, total)
        assert got["no_replay"]["metric"]["routing/mismatch_frac"] == pytest.approx(moved / total), layout
        assert got["no_replay"]["metric"]["routing/tokens"] == total, layout
        # ... and with replay every recorded (token, layer) uses exactly the recorded experts, in the
        # old-log-prob forward and in the training forward.
        assert got["replay"]["differ_valid"] == 0, layout
        assert got["train"]["differ_valid"] == 0, layout
        # The metric still reports what the live router would have chosen.
        assert got["replay"]["metric"]["routing/mismatch_frac"] > 0.1, layout
        assert got["train"]["metric"] > 0.1 and math.isfinite(got["train"]["loss"]), layout
        # Tokens without a recorded route are routed by the trainer (at the first layer, where the
        # router's input does not depend on replay, exactly as without replay).
        assert got["replay"]["invalid_first_layer_differ_live"] == 0, layout
        assert got["replay"]["invalid_first_layer_differ_recorded"] > 0, layout
    # The same replayed forward at every layout: log-probs agree (fp32 reduction order only).
    sums = [result[k]["replay"]["logprob_sum"] for k in ("tp1", "tp2_sp_ep2", "pp2")]
    assert max(sums) - min(sums) < 1e-3 * abs(sums[0])
