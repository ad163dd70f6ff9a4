"""QLoRA's NF4 base on real megatron-core (one rank, gloo on CPU): log-probs, gradients, bytes.
The models are built from the QLoRA spec (`megatron/qlora_spec.py`), as the actor builds them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml

from megatron_rl.megatron import cpu_compat
from tests.mp.launch import REPO

cpu_compat.apply()

from megatron_rl.config.schema import LoraConfig, ParallelismConfig  # noqa: E402
from megatron_rl.megatron.actor import init_parallel  # noqa: E402
from megatron_rl.megatron.devices import init_distributed  # noqa: E402
from megatron_rl.megatron.gpt import build_gpt_model  # noqa: E402
from megatron_rl.megatron.lora import apply_lora, merged_deltas  # noqa: E402
from megatron_rl.megatron.qlora_spec import for_quantized_base  # noqa: E402
from megatron_rl.megatron.quantize import (  # noqa: E402
    QuantizationError,
    dequantize,
    is_quantized,
    quantize_frozen_base,
    tensor_nbytes,
)
from megatron_rl.models import build_model  # noqa: E402
from megatron_rl.nf4 import nf4_bytes  # noqa: E402
from megatron_rl.planner.lora import dequantize_bytes_per_param  # noqa: E402

FIELDS = yaml.safe_load((REPO / "recipes/tiny/base.yaml").read_text())["model"]["tiny"]
# The on-the-fly path against a dense model holding the same dequantized weights: only fp32
# reduction-order noise may differ.
EXACT_ATOL = 1e-5
# NF4 against the unquantized model: 4-bit codes give each Gaussian weight a relative RMS error of
# ~0.1 (QLoRA's NF4 is information-theoretically optimal for normal weights, not lossless); through
# two layers the logits move by about as much, relative to their spread. 0.2 leaves room for seeds
# while a wrong block scale, transposed weight or lost layer gives errors of order 1.
WEIGHT_REL_RMS = 0.12
LOGIT_REL_RMS = 0.2


def _model() -> Any:
    model = build_gpt_model(for_quantized_base(build_model(dict(FIELDS), ParallelismConfig(), torch.float32)))
    for name, p in model.named_parameters():        # a frozen base; the embedding stands in for
        p.requires_grad_(name.startswith("embedding"))   # the trainable adapters upstream of the linears
    return model


@pytest.fixture(scope="module")
def models() -> Iterator[tuple[Any, Any, Any, Any]]:
    torch.set_num_threads(1)
    init_distributed(store=dist.HashStore())
    init_parallel(ParallelismConfig(), seed=3)
    dense, quant, same = _model(), _model(), _model()
    quant.load_state_dict(dense.state_dict())
    report = quantize_frozen_base(quant, "nf4")
    same.load_state_dict(dense.state_dict())
    with torch.no_grad():                           # the dense twin of the quantized model
        for (name, p), (qname, q) in zip(same.named_parameters(), quant.named_parameters(), strict=True):
            assert name == qname
            p.copy_(dequantize(q, p.dtype))
    yield dense, quant, same, report
    # Later tests in this process (e.g. the plugin check) expect no process group.
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _forward(model: Any, tokens: torch.Tensor, backward: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits, and the embedding's gradient of the next tokens' summed log-probs."""
    model.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, positions, None).float()
    logprobs = torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    if backward:
        logprobs.sum().backward()
    grad = model.embedding.word_embeddings.weight.grad          # None once LoRA froze the embedding
    return logits.detach(), torch.zeros(0) if grad is None else grad.clone()


def test_nf4_base_quantizes_every_frozen_linear_but_the_output_layer(models: tuple) -> None:
    dense, quant, _, report = models
    layers = FIELDS["num_hidden_layers"]
    expected = layers * (2 + 2 * FIELDS["num_experts"])        # qkv, proj, and fc1/fc2 per expert
    assert len(report.quantized) == expected and report.kept == ["output_layer"]
    quantized = {n for n, p in quant.named_parameters() if is_quantized(p)}
    assert quantized == {f"{m}.weight" for m in report.quantized}
    assert not any(is_quantized(p) for n, p in quant.named_parameters() if n.startswith(("embedding", "output")))
    for name, p in quant.named_parameters():
        if is_quantized(p):
            ref = dict(dense.named_parameters())[name]
            err = (dequantize(p, torch.float32) - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
            assert 0 < err <= WEIGHT_REL_RMS, (name, float(err))


def test_nf4_bytes_match_the_planner_and_save_most_of_the_base(models: tuple) -> None:
    _, quant, _, report = models
    assert report.bytes_before == 4 * report.params                     # fp32 base
    assert report.bytes_after == sum(tensor_nbytes(p) for p in quant.parameters() if is_quantized(p))
    # The planner's NF4 model (4-bit codes + int8 block scales + a factor per scale block) for the
    # layers' real shapes, to the byte but for torchao's 16-value lookup table and mean per tensor.
    planned = sum(nf4_bytes(dict(quant.named_modules())[m].weight.numel(), 4) for m in report.quantized)
    per_tensor_extra = report.bytes_after - planned
    assert 0 <= per_tensor_extra <= len(report.quantized) * (16 * 4 + 4), per_tensor_extra
    assert report.bytes_after < 0.14 * report.bytes_before           # ≈ 0.52 / 4 bytes per weight


def test_nf4_forward_is_the_dequantized_model_and_close_to_the_original(models: tuple) -> None:
    dense, quant, same, _ = models
    tokens = torch.randint(0, FIELDS["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    logits_q, grad_q = _forward(quant, tokens)
    logits_s, grad_s = _forward(same, tokens)
    logits_d, grad_d = _forward(dense, tokens)
    torch.testing.assert_close(logits_q, logits_s, atol=EXACT_ATOL, rtol=0)
    torch.testing.assert_close(grad_q, grad_s, atol=EXACT_ATOL, rtol=0)   # dgrad through the NF4 path
    assert grad_q.abs().sum() > 0
    spread = (logits_d - logits_d.mean(-1, keepdim=True)).pow(2).mean().sqrt()
    rel = (logits_q - logits_d).pow(2).mean().sqrt() / spread
    assert 0 < rel <= LOGIT_REL_RMS, float(rel)
    # The base never gets a gradient: only the (trainable) embedding does.
    assert [n for n, p in quant.named_parameters() if p.grad is not None] == ["embedding.word_embeddings.weight"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dequantizing_costs_what_the_planner_counts(dtype: torch.dtype) -> None:
    """The planner's transient term (planner/lora.py) against torchao's decoder, measured with
    torch's memory profiler: the running sum of every op's own allocations, peak per weight."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_rl.megatron.quantize import to_nf4

    weight = torch.randn(256, 1024, dtype=dtype, generator=torch.Generator().manual_seed(0))
    q = to_nf4(weight)
    assert q is not None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        dense = dequantize(q)
    steps = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.profiler.function_events
                   if e.self_cpu_memory_usage)
    running = peak = 0
    for _, delta in steps:
        running += delta
        peak = max(peak, running)
    assert dense.dtype == dtype
    measured = peak / weight.numel()
    assert dequantize_bytes_per_param(dense.element_size()) == pytest.approx(measured, abs=0.25), measured


def test_refuses_a_scheme_without_a_code_path(models: tuple) -> None:
    with pytest.raises(QuantizationError, match="'fp8' has no code path; allowed: nf4"):
        quantize_frozen_base(models[0], "fp8")


def test_loading_weights_into_a_quantized_base_requantizes_them(models: tuple) -> None:
    # The trainer loads its starting weights after the Actor (and so the quantization) is built:
    # `load_full_tensors` copies each dense tensor into the parameter.
    dense, quant, _, report = models
    name = f"{report.quantized[0]}.weight"
    param, ref = dict(quant.named_parameters())[name], dict(dense.named_parameters())[name]
    before = dequantize(param, torch.float32).clone()
    with torch.no_grad():
        param.copy_(ref * 2.0)
    assert is_quantized(param)
    torch.testing.assert_close(dequantize(param, torch.float32), before * 2.0, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        param.copy_(ref)
    torch.testing.assert_close(dequantize(param, torch.float32), before, atol=1e-6, rtol=0)


def _lora_twins() -> tuple[Any, Any]:
    """A QLoRA model and its dense twin (same dequantized base, same adapters, B ≠ 0)."""
    cfg = LoraConfig(rank=4, alpha=8.0)
    quant, same = _model(), _model()
    same.load_state_dict(quant.state_dict())
    for model in (quant, same):
        apply_lora(model, cfg, seed=5)
    quantize_frozen_base(quant, "nf4")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for (name, q), (_, d) in zip(quant.named_parameters(), same.named_parameters(), strict=True):
            if is_quantized(q):
                d.copy_(dequantize(q, d.dtype))
            elif q.requires_grad and "lora" in name:
                q.copy_(torch.randn(q.shape, generator=g) * 0.05)   # B ≠ 0: the adapters act
                d.copy_(q)
    return quant, same


def test_lora_on_an_nf4_base_trains_the_adapters_only(models: tuple) -> None:
    quant, same = _lora_twins()
    tokens = torch.randint(0, FIELDS["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    logits_q, _ = _forward(quant, tokens)
    logits_s, _ = _forward(same, tokens)
    torch.testing.assert_close(logits_q, logits_s, atol=EXACT_ATOL, rtol=0)
    lora = {n: p.grad for n, p in quant.named_parameters() if "lora" in n}
    twin = {n: p.grad for n, p in same.named_parameters() if "lora" in n}
    assert lora and all(g is not None and g.abs().sum() > 0 for g in lora.values())
    for name, grad in lora.items():          # dgrad through every quantized layer above the adapter
        torch.testing.assert_close(grad, twin[name], atol=EXACT_ATOL, rtol=1e-4)
    assert all(p.grad is None for p in quant.parameters() if is_quantized(p))


def test_merged_deltas_merge_into_a_dense_copy_and_put_the_nf4_base_back(models: tuple) -> None:
    quant, same = _lora_twins()
    tokens = torch.randint(0, FIELDS["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    adapted, _ = _forward(same, tokens)
    name = "decoder.layers.0.self_attention.linear_qkv"
    module = dict(quant.named_modules())[name]
    nf4 = module.weight
    with merged_deltas(quant) as touched:
        assert f"{name}.weight" in touched and not is_quantized(module.weight)
        merged, _ = _forward(quant, tokens, backward=False)    # adapters off, W + ΔW in the weight
    torch.testing.assert_close(merged, adapted, atol=1e-4, rtol=0)
    assert module.weight is nf4 and is_quantized(module.weight)
