"""QLoRA's spec at TP 2 + sequence parallelism on real megatron-core (gloo, 2 processes): the
sequence-parallel gather of the NF4 matmul and its gradient's reduction, against a float64 model
holding the dequantized weights at the same layout (tests/mp/qlora_worker.py; the GPU runs the same
worker at TP 1); and a tiny Qwen3-Next's NF4 base loaded from HF at TP 2 (the fused Gated DeltaNet
in_proj is split per section). The production QLoRA recipe is TP 4 + SP."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.helpers.models import TINY_QWEN3_NEXT
from tests.mp.launch import torchrun

LOCAL_LINEARS = ("ColumnParallelLinear", "RowParallelLinear")   # = tests/helpers/qlora.py's (imports megatron)

# As tests/unit/test_qlora_spec.py (TP 1): fp32 round-off only; bf16 moved logits by ~0.01 of their
# spread at TP 1.
FP32_LOGIT_REL_ATOL = 1e-5
FP32_GRAD_REL = 1e-4
BF16_LOGIT_REL_RMS = 0.05
SYNC_REL = 1e-6
# The HF load re-quantizes each dense shard (torchao's `copy_`), as `to_nf4` does the dense model's:
# the same shard gives the same codes, so only float round-off may differ; a shard cut across
# Gated DeltaNet's sections holds other rows, an O(1) error.
LOAD_REL = 1e-6


def test_qlora_spec_at_tp2_with_sequence_parallelism(tmp_path: Path) -> None:
    out = tmp_path / "qlora.json"
    next_dir = build_tiny_hf_checkpoint(TINY_QWEN3_NEXT, tmp_path / "qwen3_next", seed=0)
    torchrun("qlora_worker.py", str(out), str(next_dir), nproc=2)
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for r in ranks:
        assert r["device"] == "cpu" and not r["te"]
        for name in ("fp32", "bf16"):
            got = r[name]
            assert got["te_classes"] == [] and set(got["nf4_holder_classes"]) <= set(LOCAL_LINEARS), got
            assert got["with_grad"] and all(".lora_" in n for n in got["with_grad"]), got["with_grad"]
            assert len(got["with_grad"]) == got["trainable"] and got["zero_adapter_grads"] == [], got
            assert got["nf4_with_grad"] == []
        fp32 = r["fp32"]
        assert fp32["logit_max_abs_err"] <= FP32_LOGIT_REL_ATOL * fp32["logit_spread"], fp32
        assert fp32["adapter_grad_max_rel_err"] <= FP32_GRAD_REL, fp32
        assert r["bf16"]["logit_rel_rms_err"] <= BF16_LOGIT_REL_RMS, r["bf16"]
        # Qwen3-Next's QLoRA base loaded from HF at TP 2: each rank's NF4 shards, the fused GDN
        # in_proj among them, are the NF4 image of the dense model's shards.
        load = r["qwen3_next_load"]
        assert any(n.endswith("self_attention.in_proj.weight") for n in load), sorted(load)
        assert max(load.values()) <= LOAD_REL, {n: e for n, e in load.items() if e > LOAD_REL}
    sync = ranks[0]["fp32"]["sync"]          # rank 0 receives the gathered tensors
    assert sync["names_equal"] and sync["tensors"] > 0 and sync["nf4_restored"], sync
    assert sync["max_rel_err"] <= SYNC_REL, sync
