"""Tiny model shapes and the fixtures that build them, shared by the unit and integration tiers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.mp.launch import REPO, torchrun

TINY_MOE: dict[str, Any] = yaml.safe_load((REPO / "recipes/tiny/base.yaml").read_text())["model"]["tiny"]
_MOE_ONLY = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size")
TINY_DENSE: dict[str, Any] = {**{k: v for k, v in TINY_MOE.items() if k not in _MOE_ONLY},
                              "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}

# Also a case of tests/integration/test_convert.py. Sizes vLLM's CPU backend accepts for Qwen3-Next (bf16 only
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


DENSE_TIED: dict[str, Any] = {**TINY_DENSE, "tie_word_embeddings": True}


def perturbed_checkpoint(out: Path, fields: dict[str, Any] = TINY_QWEN3_NEXT) -> Path:
    """The tiny checkpoint with non-trivial norms, decays and conv weights.

    A fresh HF model has every norm at its identity value (zero-centred w = 0, GDN norm w = 1), so
    a transposed or offset norm weight would go unnoticed. Here every 1-D tensor gets noise, and
    the weights are 4× the initializer's scale so logits are O(1).
    """
    from transformers import AutoModelForCausalLM

    base = build_tiny_hf_checkpoint(fields, out / "base", seed=0)
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
    ckpt = perturbed_checkpoint(root)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tokens = torch.randint(0, TINY_QWEN3_NEXT["vocab_size"], (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens).logits
    torch.save({"tokens": tokens, "logits": logits}, root / "ref.pt")
    return ckpt, root / "ref.pt"


# ------------------------------------------------------------------ megatron-core sees the keys
@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_checkpoint(TINY_MOE, tmp_path_factory.mktemp("tiny_moe"), seed=0)


def _memory_options(tiny_moe: Path, out: Path, nproc: int, cuda: bool = False) -> dict:
    torchrun("memory_options_worker.py", str(tiny_moe), str(out), nproc=nproc, cuda=cuda)
    return json.loads(out.read_text())
