"""QLoRA on one GPU (TP 1): the tiny Qwen3-MoE built from the QLoRA spec with its NF4 base on CUDA —
TE's norms and attention where TE is installed, the local linears holding the base. Forward and
adapter gradients against a float64 model holding the dequantized weights, adapters-only gradients,
the first sync's merged weights, and the planner's dequantize term against CUDA's peak memory.

Bounds: fp32 on the same weights is round-off only (1.8e-6 of the logits' spread measured on CPU;
50× that here for other kernels' reduction orders); bf16 moved the logits by 0.011 of their spread
on CPU (bf16 matmuls and norms), so 0.05; the sync's W + ΔW is one fp32 rounding of each term.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.planner.lora import dequantize_bytes_per_param
from tests.helpers.gpu import require
from tests.mp.launch import torchrun

LOCAL_LINEARS = ("ColumnParallelLinear", "RowParallelLinear")   # = tests/helpers/qlora.py's (imports megatron)

pytestmark = pytest.mark.gpu
FP32_LOGIT_REL_ATOL = 1e-4
FP32_GRAD_REL = 1e-3
BF16_LOGIT_REL_RMS = 0.05
SYNC_REL = 1e-6


def test_qlora_spec_with_an_nf4_base_on_one_gpu(tmp_path: Path) -> None:
    require("torchao", why="QLoRA's NF4 base")
    out = tmp_path / "qlora.json"
    torchrun("qlora_worker.py", str(out), nproc=1, cuda=True)
    (r,) = json.loads(out.read_text())
    assert r["device"] == "cuda:0"
    # The TE pieces exactly where TE can be used; TENorm's modules are TE's `RMSNorm`.
    assert r["te"] == r["te_installed"]
    for name in ("fp32", "bf16"):
        got = r[name]
        assert got["te_classes"] == (["TEDotProductAttention"] if r["te"] else []), got["te_classes"]
        assert got["nf4_modules"] > 0 and set(got["nf4_holder_classes"]) <= set(LOCAL_LINEARS), got
        assert got["param_devices"] == ["cuda:0"] and got["nf4_storage_devices"] == ["cuda:0"], got
        assert got["with_grad"] and all(".lora_" in n for n in got["with_grad"]), got["with_grad"]
        assert len(got["with_grad"]) == got["trainable"] and got["zero_adapter_grads"] == [], got
        assert got["nf4_with_grad"] == []
    fp32, bf16 = r["fp32"], r["bf16"]
    assert fp32["logit_max_abs_err"] <= FP32_LOGIT_REL_ATOL * fp32["logit_spread"], fp32
    assert fp32["adapter_grad_max_rel_err"] <= FP32_GRAD_REL, fp32
    assert bf16["logit_rel_rms_err"] <= BF16_LOGIT_REL_RMS, bf16
    sync = fp32["sync"]
    assert sync["names_equal"] and sync["tensors"] > 0 and sync["nf4_restored"], sync
    assert sync["max_rel_err"] <= SYNC_REL, sync
    # planner/lora.py's transient term: torchao's decoder working set, bf16 (allocator rounding aside).
    peak = r["dequantize_peak_bytes_per_param_bf16"]
    assert 2 <= peak <= dequantize_bytes_per_param(2) + 0.5, peak
