"""Qwen3-Next's GDN output norm in Megatron-Bridge's convention.

HF stores the plain-scale weight w (y = x̂·w); Megatron's zero-centred norm stores p = w − 1
(y = x̂·(1 + p)), which is what Megatron-Bridge's `RMSNorm2ZeroCenteredRMSNormMapping` writes under
`decoder.layers.N.self_attention.out_norm.weight` (subtract 1 on import, add 1 on export, in the
tensor's dtype). Our weight map must do exactly that, so the dist checkpoints interchange; that the
model computes x̂·(1 + p) is covered by the logits-parity tests (norm weights moved off 1 there).
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_rl.models import weight_map
from tests.helpers.models import TINY_QWEN3_NEXT


def _bridge_import(w: torch.Tensor) -> torch.Tensor:
    """Megatron-Bridge's hf_to_megatron for this mapping: `hf_weights.clone(); data -= 1`."""
    out = w.clone()
    out.data -= 1
    return out


def _bridge_export(p: torch.Tensor) -> torch.Tensor:
    out = p.clone()
    out.data += 1
    return out


def _out_norm_entries() -> list:
    adapter = weight_map(TINY_QWEN3_NEXT)
    return [e for e in adapter.entries if e.mcore.endswith("out_norm.weight")]


def test_out_norm_names_are_the_bridges() -> None:
    entries = _out_norm_entries()
    linear = [i for i, t in enumerate(["linear_attention", "full_attention"] * 2) if t == "linear_attention"]
    assert [e.mcore for e in entries] == [f"decoder.layers.{i}.self_attention.out_norm.weight" for i in linear]
    assert [e.hf for e in entries] == [(f"model.layers.{i}.linear_attn.norm.weight",) for i in linear]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_are_the_bridges_and_round_trip_exactly_from_half(dtype: torch.dtype) -> None:
    entry = _out_norm_entries()[0]
    adapter = weight_map(TINY_QWEN3_NEXT)
    w = (0.5 + 7.5 * torch.rand(4096, generator=torch.Generator().manual_seed(0))).to(dtype)  # [0.5, 8)
    p = adapter.to_mcore(entry, {entry.hf[0]: w})
    assert p.dtype == dtype and torch.equal(p, _bridge_import(w))
    ((_, back),) = adapter.to_hf(entry, p)
    assert torch.equal(back, _bridge_export(p)) and torch.equal(back, w)


def test_weights_below_half_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    entry = _out_norm_entries()[0]
    adapter = weight_map(TINY_QWEN3_NEXT)
    w = torch.tensor([0.7, 0.3001, 0.01, 1.5], dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        p = adapter.to_mcore(entry, {entry.hf[0]: w})
    ((_, back),) = adapter.to_hf(entry, p)
    lost = int((back != w).sum())
    assert lost >= 1 and back[0] == w[0] and back[3] == w[3]
    assert f"{lost} of 4 weights below 0.5" in caplog.text and entry.hf[0] in caplog.text
