"""What the first GPU run needs, proven on CPU where the same code runs: Transformer-Engine
parameter names in the weight map, one metrics writer, vLLM's per-worker RPC results, the
server's environment and sampling defaults, bf16-aware verification statistics, the TE log-prob
glue, and the device placement of a batch."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.mp.launch import torchrun
from tests.rollout_fixtures import TINY_MOE
from tests.test_qwen3_next import TINY_QWEN3_NEXT


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
