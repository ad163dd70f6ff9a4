"""Qwen3-Next (hybrid Gated DeltaNet + gated attention, MoE with shared expert) in Megatron on CPU.

Megatron runs in subprocesses: cpu_compat patches torch.cuda for the whole process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.models.qwen3_next.layers import layer_types
from megatron_rl.weights.adapters import adapter_for
from megatron_rl.weights.hf_io import HFCheckpointReader
from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.mp.launch import REPO, torchrun

# Also a case of tests/test_convert.py. Sizes vLLM's CPU backend accepts for Qwen3-Next (bf16 only
# there): full-attention head_dim ≥ 32, linear-attention key/value head dims ≥ 64, hidden and MoE
# sizes multiples of 32. Two of each layer type; layer 0 dense (mlp_only_layers) so both MLP kinds
# are covered.
TINY_QWEN3_NEXT: dict[str, Any] = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=256, hidden_size=64,
    num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    partial_rotary_factor=0.25, rope_theta=1000000.0, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, intermediate_size=64,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
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


def _perturbed_checkpoint(out: Path) -> Path:
    """The tiny checkpoint with non-trivial norms, decays and conv weights.

    A fresh HF model has every norm at its identity value (zero-centred w = 0, GDN norm w = 1), so
    a transposed or offset norm weight would go unnoticed. Here every 1-D tensor gets noise, and
    the weights are 4× the initializer's scale so logits are O(1).
    """
    from transformers import AutoModelForCausalLM

    base = build_tiny_hf_checkpoint(TINY_QWEN3_NEXT, out / "base", seed=0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.mul_(4.0)
    model.save_pretrained(out / "perturbed")
    return out / "perturbed"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(checkpoint dir, reference .pt with tokens and HF fp32 logits)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("qwen3_next")
    ckpt = _perturbed_checkpoint(root)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tokens = torch.randint(0, TINY_QWEN3_NEXT["vocab_size"], (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens).logits
    torch.save({"tokens": tokens, "logits": logits}, root / "ref.pt")
    return ckpt, root / "ref.pt"


def test_layer_pattern_from_interval_or_layer_types() -> None:
    released = {"num_hidden_layers": 8, "full_attention_interval": 4}    # Qwen3-Next-80B style
    assert layer_types(released) == (["linear_attention"] * 3 + ["full_attention"]) * 2
    written = {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]}
    assert layer_types(written) == ["full_attention", "linear_attention"]
    with pytest.raises(ValueError):
        layer_types({"num_hidden_layers": 2, "layer_types": ["full_attention"]})


def test_weight_map_covers_the_saved_checkpoint_and_inverts_exactly(tiny: tuple[Path, Path]) -> None:
    ckpt, _ = tiny
    reader = HFCheckpointReader(ckpt)
    adapter = adapter_for(json.loads((ckpt / "config.json").read_text()))
    assert sorted(adapter.hf_names()) == sorted(reader.names())      # per-expert tensors on disk
    for entry in adapter.entries:
        parts = {n: reader.get(n) for n in entry.hf}
        back = dict(adapter.to_hf(entry, adapter.to_mcore(entry, parts)))
        assert all(torch.equal(back[n], parts[n]) for n in entry.hf), entry.mcore


def test_gdn_torch_delta_rule_matches_a_naive_recurrence() -> None:
    """Megatron's chunked torch delta rule (the CPU path) against the per-token recurrence
    S_t = e^{g_t} S_{t-1} + β_t k_t (v_t − e^{g_t} S_{t-1}ᵀ k_t)ᵀ, o_t = S_tᵀ q_t / √d_k, in float64.
    The kernel computes in fp32 whatever its input: 150 tokens (three chunks of 64, the last one
    padded) stay within 5e-6 of outputs of magnitude ~1 (measured 7e-7)."""
    proc = subprocess.run([sys.executable, str(REPO / "tests/mp/gdn_kernel_check.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_out"] > 0.5
    assert result["max_diff"] <= 5e-6, result


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


@pytest.mark.slow
def test_single_process_matches_hf_round_trips_and_trains(single_process: dict[str, Any]) -> None:
    _check_against_hf(single_process, "tp1")
    assert single_process["losses"][0] != single_process["losses"][1]     # the first step changed the policy
    assert len(single_process["weights"]) == 69 and len(single_process["grads"]) == 69
    gdn_grads = [g for k, g in single_process["grads"].items() if ".self_attention.in_proj" in k or "A_log" in k]
    assert gdn_grads and all(g.abs().max() > 0 for g in gdn_grads)         # backward reaches the GDN layers


@pytest.mark.slow
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
