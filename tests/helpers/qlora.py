"""QLoRA-spec checks shared by the CPU unit test (gloo, in process) and the GPU worker (CUDA).

A QLoRA model is built the way the actor builds it (`for_quantized_base` → `build_gpt_model` →
`apply_lora` → `quantize_frozen_base`); its twin holds the same weights densely in float64 (the NF4
base dequantized, the same adapters) and is built from the same spec without the TE pieces (TE has
no float64 kernels). Each check returns plain numbers and names, so the GPU worker can write them
as JSON and both tiers assert the same bounds.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch

from megatron_rl.config.schema import LoraConfig, ParallelismConfig
from megatron_rl.megatron.gpt import ModelRecipe, build_gpt_model
from megatron_rl.megatron.lora import apply_lora, lora_modules, merged_deltas
from megatron_rl.megatron.qlora_spec import for_quantized_base
from megatron_rl.megatron.quantize import dequantize, is_quantized, quantize_frozen_base, to_nf4
from megatron_rl.models import build_model, weight_map
from megatron_rl.sync import sync_weights

LORA = LoraConfig(rank=4, alpha=8.0, targets=["q", "k", "v", "o", "experts"], base_quantization="nf4")
LOCAL_LINEARS = ("ColumnParallelLinear", "RowParallelLinear")


def qlora_recipe(hf: dict[str, Any], dtype: torch.dtype, te: bool | None = None,
                 layout: ParallelismConfig | None = None) -> ModelRecipe:
    """The actor's QLoRA recipe (TP 1 by default); `te` forces the pieces (None: TE where it can
    be used)."""
    recipe = for_quantized_base(build_model(dict(hf), layout or ParallelismConfig(), dtype))
    if te is not None:
        recipe.layer_spec = partial(recipe.layer_spec, te=te)
    return recipe


def qlora_model(hf: dict[str, Any], dtype: torch.dtype, device: torch.device,
                layout: ParallelismConfig | None = None, lora: LoraConfig = LORA) -> tuple[Any, Any]:
    """(model, quantization report): adapters on every target, B ≠ 0 so they act."""
    model = build_gpt_model(qlora_recipe(hf, dtype, layout=layout)).to(device)
    apply_lora(model, lora, seed=5)
    report = quantize_frozen_base(model, "nf4")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in lora_modules(model):
            m.b.copy_(torch.randn(m.b.shape, generator=g) * 0.05)
    return model, report


def float64_twin(hf: dict[str, Any], quant: Any, device: torch.device, layout: ParallelismConfig | None = None,
                 lora: LoraConfig = LORA) -> Any:
    """The dense float64 model holding exactly the weights `quant` computes with (plain torch: no
    TE pieces, no fused SwiGLU / bias-dropout-add, which the GPU config turns on)."""
    recipe = qlora_recipe(hf, torch.float64, te=False, layout=layout)
    recipe.config = dataclasses.replace(recipe.config, bias_activation_fusion=False, bias_dropout_fusion=False)
    twin = build_gpt_model(recipe).to(device)
    apply_lora(twin, lora, seed=5)
    source = dict(quant.named_parameters())
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(dequantize(source[name]).to(device, torch.float64))
    return twin


def dequantize_peak_bytes_per_param(device: torch.device, dtype: torch.dtype) -> float:
    """Peak CUDA memory of dequantizing one NF4 weight, per weight (the planner's transient term)."""
    weight = torch.randn(1024, 4096, dtype=dtype, device=device)
    q = to_nf4(weight)
    assert q is not None
    del weight
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    dense = dequantize(q)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    return peak / dense.numel()


def nf4_holders(model: Any) -> dict[str, str]:
    """Module name → class of every module whose weight is NF4."""
    return {n: type(m).__name__ for n, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor) and is_quantized(m.weight)}


def te_classes(model: Any) -> list[str]:
    """Classes named like Transformer Engine's (the spec's TE pieces, never a TE linear)."""
    return sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("TE")})


def tokens(vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed)).to(device)


def logprob_sum_backward(model: Any, toks: torch.Tensor) -> torch.Tensor:
    """Logits (float64, detached) after one backward of the tokens' summed next-token log-probs
    (under TP of this rank's vocabulary shard, targets folded into it: a scalar both models share)."""
    model.zero_grad(set_to_none=True)
    positions = torch.arange(toks.shape[1], device=toks.device).unsqueeze(0).expand_as(toks)
    logits = model(toks, positions, None)
    targets = toks[:, 1:, None] % logits.shape[-1]
    logp = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, targets).squeeze(-1)
    logp.sum().backward()
    return logits.detach().double()


def forward_and_grads(quant: Any, twin: Any, toks: torch.Tensor) -> dict[str, Any]:
    """The QLoRA model against its float64 twin: logits and adapter gradients; which parameters
    got a gradient."""
    got, want = logprob_sum_backward(quant, toks), logprob_sum_backward(twin, toks)
    spread = (want - want.mean(-1, keepdim=True)).pow(2).mean().sqrt()
    with_grad = sorted(n for n, p in quant.named_parameters() if p.grad is not None)
    twin_grads = {n: p.grad for n, p in twin.named_parameters()}
    grad_err = max(float((p.grad.double() - twin_grads[n]).abs().max() / twin_grads[n].abs().max())
                   for n, p in quant.named_parameters() if p.grad is not None)
    return {"logit_max_abs_err": float((got - want).abs().max()), "logit_spread": float(spread),
            "logit_rel_rms_err": float((got - want).pow(2).mean().sqrt() / spread),
            "with_grad": with_grad, "adapter_grad_max_rel_err": grad_err,
            "zero_adapter_grads": [n for n, p in quant.named_parameters()
                                   if p.grad is not None and not bool(p.grad.abs().sum() > 0)],
            "nf4_with_grad": [n for n, p in quant.named_parameters() if is_quantized(p) and p.grad is not None]}


class Capture:
    """A transport that keeps what the sync sends (float64 copies, by HF name)."""

    def __init__(self) -> None:
        self.sent: dict[str, torch.Tensor] = {}

    def begin(self, version: int) -> None:
        pass

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        self.sent.update({n: t.detach().to("cpu", torch.float64).clone() for n, t in tensors.items()})

    def finish(self, names: list[str]) -> dict[str, Any]:
        return {}

    def abort(self) -> None:
        pass


def merged_sync(hf: dict[str, Any], quant: Any, twin: Any, dtype: torch.dtype) -> dict[str, Any]:
    """QLoRA's first sync (every tensor, adapters merged into the dequantized base, as
    `sync/lora.py::sync_actor` sends it) against the float64 twin's merged weights."""
    adapter = weight_map(hf)
    got, want = Capture(), Capture()
    with merged_deltas(quant):
        sync_weights(quant, adapter, got, 0, dtype)
    still_nf4 = all(is_quantized(m.base.weight) for m in lora_modules(quant))
    with merged_deltas(twin):
        sync_weights(twin, adapter, want, 0, torch.float64)
    # Only global rank 0 receives the gathered tensors (the others' captures stay empty).
    err = max((float((got.sent[n] - t).abs().max() / max(float(t.abs().max()), 1e-30))
               for n, t in want.sent.items()), default=0.0)
    return {"names_equal": sorted(got.sent) == sorted(want.sent), "tensors": len(got.sent),
            "max_rel_err": err, "nf4_restored": still_nf4}


def hf_load_errors(hf: dict[str, Any], hf_dir: str, device: torch.device,
                   layout: ParallelismConfig) -> dict[str, float]:
    """Per NF4 weight of this rank: max |Δ| (relative to its max) between what QLoRA holds after
    the HF load and the NF4 image of the dense model's shard at the same layout.

    The actor quantizes first and loads the HF checkpoint afterwards (`train/policy.py`), so the
    load shards through the NF4 parameter's attributes: one that lost Gated DeltaNet's per-section
    tag cuts the fused in_proj [q; k; v; z; β; α] in contiguous TP chunks. The gather undoes the
    same cut, so only a comparison on the trainer's own shards shows it."""
    from megatron_rl.weights.loading import load_hf_into_model

    def frozen(quantized: bool) -> Any:
        recipe = for_quantized_base(build_model(dict(hf), layout, torch.float32))
        model = build_gpt_model(recipe).to(device)
        for p in model.parameters():
            p.requires_grad_(False)
        if quantized:
            quantize_frozen_base(model, "nf4")
        load_hf_into_model(model, hf_dir, weight_map(hf))
        return model

    quant, dense = dict(frozen(True).named_parameters()), dict(frozen(False).named_parameters())
    errors = {}
    for name, p in quant.items():
        if is_quantized(p):
            q = to_nf4(dense[name])
            assert q is not None
            want = dequantize(q)
            errors[name] = float((dequantize(p) - want).abs().max() / want.abs().max().clamp_min(1e-30))
    return errors
