"""What the first GPU run needs, proven on CPU where the same code runs: Transformer-Engine
parameter names in the weight map, one metrics writer, vLLM's per-worker RPC results, the
server's environment and sampling defaults, bf16-aware verification statistics, the TE log-prob
glue, and the device placement of a batch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.helpers.models import TINY_MOE, TINY_QWEN3_NEXT
from tests.mp.launch import REPO, torchrun


@pytest.mark.parametrize("fields,layouts", [(TINY_MOE, "tp2_sp,ep2"), (TINY_QWEN3_NEXT, "tp2_sp")],
                         ids=["qwen3_moe", "qwen3_next"])
def test_weight_map_accepts_transformer_engine_names(fields: dict, layouts: str, tmp_path: Path) -> None:
    model = build_tiny_hf_checkpoint(fields, tmp_path / "model", seed=2)
    out = tmp_path / "te.json"
    torchrun("te_names_worker.py", str(model), layouts, str(out))
    result = json.loads(out.read_text())
    layers = fields["num_hidden_layers"]
    dense_layers = len(fields.get("mlp_only_layers") or [])
    for layout in layouts.split(","):
        r = result[layout]
        # Every layer's input norm, plus the dense layers' pre-MLP norm, carried TE's fused name;
        # the experts carried grouped-GEMM names (fc1 and fc2 of every expert, over both ranks
        # under EP, on both TP ranks otherwise).
        assert r["te_norm_names"] == (layers + dense_layers) * 2, r
        assert r["te_grouped_expert_names"] > 0, r
        assert r["missing"] == [] and r["extra"] == [] and r["mismatched"] == [], r
    # The alias table is megatron's own local→TE key map, inverted, for every layer spec used.
    table = result["alias_table"]["table"]
    for keys in result["alias_table"]["spec_maps"]:
        for local, te in keys.items():
            assert table[te] == local, (te, local, table)


def test_only_rank0_writes_metrics_and_wandb_gets_the_resolved_recipe(tmp_path: Path) -> None:
    out = tmp_path / "metrics.json"
    torchrun("metrics_worker.py", str(REPO / "recipes/tiny/grpo.yaml"), str(tmp_path / "run"), str(out))
    r = json.loads(out.read_text())
    assert [x["has_log"] for x in r["ranks"]] == [True, False]
    assert [x["wandb_inits"] for x in r["ranks"]] == [1, 0]
    assert r["ranks"][0]["wandb_config_is_resolved_recipe"]
    assert [(x["step"], x["rank"]) for x in r["lines"]] == [(1, 0.0), (2, 0.0)]   # one writer, no duplicates
    assert r["world_backend"] == r["backend"] == "gloo"                             # CPU: gloo only
