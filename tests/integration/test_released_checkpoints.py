"""Checkpoints shaped like the releases (Qwen3-Next-80B-A3B, Qwen3-235B-A22B, Qwen3-30B-A3B): the
released config.json (every key, bf16), the released tensor names including Qwen3-Next's `mtp.*`,
sharded safetensors with an index, at small width. They convert both ways at several layouts, and
load through the trainer's path (`load_hf_into_model`) at PP=2 and PP=2 × TP=2 with the logits of
transformers, including `num_query_groups < TP` and a tied-embedding model (whose last pipeline stage
kept a random LM head before `sharding.tied_output_copies`).

All distributed work runs in ONE torchrun launch of 4 gloo processes (tests/mp/released_worker.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.weights.hf_io import HFCheckpointReader
from megatron_rl.weights.tiny import build_release_shaped_checkpoint
from tests.helpers.models import DENSE_TIED
from tests.mp.launch import REPO, torchrun

RELEASED = REPO / "recipes" / "models"
# Small widths that keep each release's proportions: head_dim ≠ hidden / heads as released, heads
# per KV head as released (so KV heads < TP = 2 for the 80B and 235B shapes), v/k GDN head ratio 2.
CASES: dict[str, dict[str, Any]] = {
    "qwen3_next_80b_a3b": dict(
        released="qwen3_next_80b_a3b", mtp_layers=1, layouts=["tp1", "tp2_pp2", "pp2"],
        parity=["pp2", "tp2_pp2"],
        width=dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=1, head_dim=16,
                   intermediate_size=96, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, vocab_size=256)),
    "qwen3_235b_a22b": dict(
        released="qwen3_235b_a22b", layouts=["tp1", "tp2_pp2_ep2"], parity=["pp2", "tp2_pp2"],
        width=dict(hidden_size=64, num_attention_heads=16, num_key_value_heads=1, head_dim=8,
                   intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                   num_hidden_layers=4, max_window_layers=4, vocab_size=256)),
    "qwen3_30b_a3b": dict(
        released="qwen3_30b_a3b", layouts=["tp2_pp2", "pp2"], parity=["tp2_pp2_ep2"],
        width=dict(hidden_size=64, num_attention_heads=16, num_key_value_heads=2, head_dim=8,
                   intermediate_size=96, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                   num_hidden_layers=4, max_window_layers=4, vocab_size=256)),
    "qwen3_dense_tied": dict(released=None, layouts=["pp2", "tp1"], parity=["pp2", "tp2_pp2"], width={}),
}
# fp32 on both sides, bf16 weights upcast exactly; the implementations differ in reduction order
# only (measured ≤ 1e-5 with logits std ≈ 0.7); a wrong head, shard or norm is off by O(0.1–1).
LOGITS_ATOL = 1e-4
TOKENS = (2, 16)      # sequence length divisible by TP (sequence parallelism)


def _released(case: dict[str, Any]) -> dict[str, Any]:
    if case["released"] is None:
        return DENSE_TIED
    return json.loads((RELEASED / case["released"] / "config.json").read_text())


def _reference(hf_dir: Path, vocab: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, vocab, TOKENS, generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits
    assert logits.std() > 0.2      # O(1) logits: a wrong weight cannot hide under the tolerance
    return {"tokens": tokens, "logits": logits}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("released")
    spec: dict[str, Any] = {"cases": {}}
    for name, case in CASES.items():
        released = _released(case)
        src = build_release_shaped_checkpoint(released, case["width"], root / name, seed=0,
                                              mtp_layers=case.get("mtp_layers", 0))
        torch.save(_reference(src, case["width"].get("vocab_size", released["vocab_size"])), root / f"{name}.pt")
        (root / f"{name}_work").mkdir()
        spec["cases"][name] = {"hf_dir": str(src), "work": str(root / f"{name}_work"), "layouts": case["layouts"],
                               "parity_layouts": case["parity"], "reference": str(root / f"{name}.pt")}
    (root / "spec.json").write_text(json.dumps(spec))
    torchrun("released_worker.py", str(root / "spec.json"), str(root / "result.json"), nproc=4, timeout=1500)
    return {"spec": spec, "result": json.loads((root / "result.json").read_text())}


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]["released"]])
def test_release_shape(run: dict[str, Any], name: str) -> None:
    """The fixture really is release-shaped: every released config key and value except the
    widths, bf16 tensors in several shards with an index, and (80B) the MTP block."""
    src = Path(run["spec"]["cases"][name]["hf_dir"])
    config = json.loads((src / "config.json").read_text())
    released = _released(CASES[name])
    assert set(config) == set(released)
    assert {k: v for k, v in config.items() if k not in CASES[name]["width"]} == \
        {k: v for k, v in released.items() if k not in CASES[name]["width"]}
    reader = HFCheckpointReader(src)
    assert (src / "model.safetensors.index.json").is_file() and len(reader.shard_files()) >= 3
    assert {reader.get(n).dtype for n in reader.names()} == {torch.bfloat16}
    mtp = {n for n in reader.names() if n.startswith("mtp.")}
    assert bool(mtp) == bool(CASES[name].get("mtp_layers"))
    if mtp:
        assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
                "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.experts.7.down_proj.weight",
                "mtp.layers.0.mlp.shared_expert_gate.weight"} <= mtp


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_bit_identical_apart_from_mtp(run: dict[str, Any], name: str) -> None:
    src = Path(run["spec"]["cases"][name]["hf_dir"])
    result = run["result"][name]
    original = HFCheckpointReader(src)
    mtp = sorted(n for n in original.names() if n.startswith("mtp."))
    for first, dropped in result["dropped"].items():
        assert dropped == mtp, first                           # listed, in <out>/hf/dropped_tensors.json too
    for pair, back in result["roundtrip"].items():
        converted = HFCheckpointReader(back)
        assert sorted(converted.names()) == sorted(set(original.names()) - set(mtp)), pair
        for n in converted.names():
            a, b = original.get(n), converted.get(n)
            assert a.dtype == b.dtype and torch.equal(a, b), f"{pair}: {n}"
        assert json.loads((Path(back) / "config.json").read_text()) == \
            json.loads((src / "config.json").read_text()), pair


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_at_pp2_and_tp2_pp2(run: dict[str, Any], name: str) -> None:
    parity = run["result"][name]["parity"]
    assert set(parity) == set(CASES[name]["parity"])
    for layout, diff in parity.items():
        assert diff < LOGITS_ATOL, f"{name} at {layout}: max |Δ logits| = {diff:.3g}"
