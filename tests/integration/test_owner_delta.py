"""Delta syncs compared by the owners of the weights (`sync/owners.py`), from a real Megatron MoE
model in TP 2 + EP 2 and PP 2 (2 gloo processes, `tests/mp/owner_delta_worker.py`): the round after
a whole one is a delta, its bytes a fraction of the whole, the changed fraction the owners count is
the true one, and the server (vLLM's patch loader on the previous version) holds bit for bit what
the whole gather gives. A NaN in a non-zero rank's weights stops every rank after the gather; a
round rank 0 cannot begin stops every rank before it; servers that cannot take patches in place
get whole rounds, with no host copies kept."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.models import TINY_MOE
from tests.helpers.rollout import tiny_model_with_tokenizer
from tests.mp.launch import torchrun


def test_owners_compare_their_parts_and_the_server_holds_the_whole_gathers_tensors(tmp_path: Path) -> None:
    model = tiny_model_with_tokenizer(TINY_MOE, tmp_path / "model", seed=4)
    out = tmp_path / "owners.json"
    torchrun("owner_delta_worker.py", str(model), "tp2_ep2_etp1,pp2", str(tmp_path / "node-shm"), str(out))
    result = json.loads(out.read_text())
    assert list(result) == ["tp2_ep2_etp1", "pp2"]
    for layout, r in result.items():
        assert r["dense"] == [1, 0], (layout, r)                        # whole, then a delta
        assert r["bit_identical"], (layout, r)                          # every tensor, bit for bit
        # ~1 % of the elements moved (each shard's own; 3 × 4 bytes per changed fp32 element).
        assert 0.005 < r["true_frac"] < 0.02 and abs(r["changed_frac"] - r["true_frac"]) < 1e-12, (layout, r)
        assert r["bytes"][1] < 0.05 * r["bytes"][0], (layout, r)
        assert r["patched"] == r["changed_tensors"] > 0, (layout, r)
        assert not r["receiver_alive"], (layout, r)                     # the transport closed its group
        assert not list((tmp_path / "node-shm" / layout).iterdir())     # and the node's copy went with it
        # NaN in rank 1's weights: both ranks stop after the gather, rank 1 naming its own tensors.
        assert all("hold NaN (the training diverged)" in said for said in r["nan_stopped"]), (layout, r)
        assert "this rank's: model." in r["nan_stopped"][1], (layout, r)
        # Rank 0's transport refuses to begin: every rank stops before the gather, rank 1 told so.
        assert r["refused"] == ["the servers refused the round",
                                "weight sync: trainer rank 0 could not begin the round (its log says why)"], (layout, r)
        # Servers that cannot take patches in place: a whole round, and no owner keeps host copies.
        assert r["plain"]["held"] == [0, 0] and r["plain_identical"], (layout, r)
        assert r["plain"]["sent"]["dense"] == 1 and r["plain"]["sent"]["changed_frac"] == 1.0, (layout, r)
