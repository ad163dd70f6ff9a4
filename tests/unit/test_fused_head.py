"""The fused LM head (hidden states + weight → log-probs, entropy) vs a float64 reference through
explicit logits; TP 2 (+ SP) runs in `test_logprobs.py`'s two-process launch."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.fused_head import fused_head_logprobs
from megatron_rl.logprobs import vocab_parallel_logprobs
from tests.helpers.logprobs import make_head, reference


def _grads(outputs: tuple[Tensor, Tensor | None], inputs: tuple[Tensor, ...], w1: Tensor, w2: Tensor) -> tuple:
    logp, entropy = outputs
    loss = (logp.double() * w1).sum() + (0 if entropy is None else (entropy.double() * w2).sum())
    return torch.autograd.grad(loss, inputs)


def _reference(hidden: Tensor, weight: Tensor, target: Tensor, temperature: float, w1: Tensor,
               w2: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """float64 log-probs, entropy and the gradients of hidden and weight, through full logits."""
    h, w = hidden.double().detach().requires_grad_(), weight.double().detach().requires_grad_()
    logp, entropy = reference(h @ w.t(), target, temperature)
    gh, gw = _grads((logp, entropy), (h, w), w1, w2)
    return logp, entropy, gh, gw


@pytest.mark.parametrize("chunk_size", [1, 5, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float64_matches_reference(chunk_size: int | None, temperature: float) -> None:
    hidden, weight, target, w1, w2 = make_head(23, 8, 41, torch.float64)   # 5 does not divide 23 rows
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_head_logprobs(h, w, target, temperature=temperature, chunk_size=chunk_size)
    ref_lp, ref_h, ref_gh, ref_gw = _reference(hidden, weight, target, temperature, w1, w2)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.entropy, ref_h, atol=1e-12, rtol=0)
    gh, gw = _grads((out.logprobs, out.entropy), (h, w), w1, w2)
    torch.testing.assert_close(gh, ref_gh, atol=1e-12, rtol=0)
    torch.testing.assert_close(gw, ref_gw, atol=1e-12, rtol=0)


def test_float32_within_1e5_of_float64_reference() -> None:
    hidden, weight, target, w1, w2 = make_head(37, 16, 300, torch.float32, seed=1)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_head_logprobs(h, w, target, temperature=0.8, chunk_size=10)
    assert out.logprobs.dtype == torch.float32 and out.entropy is not None
    ref_lp, ref_h, ref_gh, ref_gw = _reference(hidden, weight, target, 0.8, w1, w2)
    torch.testing.assert_close(out.logprobs.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ref_h, atol=1e-5, rtol=0)
    gh, gw = _grads((out.logprobs, out.entropy), (h, w), w1, w2)
    assert gh.dtype == gw.dtype == torch.float32
    # The weight's gradient sums 37 rows of O(1) terms: 1e-5 relative to its largest entry.
    torch.testing.assert_close(gh.double(), ref_gh, atol=1e-5 * float(ref_gh.abs().max()), rtol=0)
    torch.testing.assert_close(gw.double(), ref_gw, atol=1e-5 * float(ref_gw.abs().max()), rtol=0)


def test_bfloat16_equals_the_unfused_path_on_the_same_logits() -> None:
    """bf16 weights: the same bf16 logits GEMM as the output layer, then the same chunked pass; the
    gradients are the unfused path's (bf16 logits gradient through bf16 GEMMs) up to bf16 rounding
    of the per-chunk partial sums of the weight's gradient, accumulated in fp32."""
    hidden, weight, target, w1, w2 = make_head(29, 32, 96, torch.bfloat16, seed=2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_head_logprobs(h, w, target, temperature=0.9, chunk_size=8)
    hu, wu = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    unfused = vocab_parallel_logprobs(hu @ wu.t(), target, temperature=0.9, chunk_size=8)
    torch.testing.assert_close(out.logprobs, unfused.logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.entropy, unfused.entropy, atol=1e-6, rtol=0)
    gh, gw = _grads((out.logprobs, out.entropy), (h, w), w1, w2)
    ugh, ugw = _grads((unfused.logprobs, unfused.entropy), (hu, wu), w1, w2)
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(gh.double(), ugh.double(), atol=1e-2 * float(ugh.abs().max()), rtol=0)
    torch.testing.assert_close(gw.double(), ugw.double(), atol=1e-2 * float(ugw.abs().max()), rtol=0)


def test_tied_embeddings_get_both_gradients() -> None:
    """The weight is also the embedding table the hidden states were looked up from: its gradient is
    the head's plus the lookup's (autograd adds them; the fused head returns its part)."""
    _, weight, target, w1, w2 = make_head(19, 8, 30, torch.float64, seed=3)
    ids = torch.randint(0, 30, (19,), generator=torch.Generator().manual_seed(9))
    mix = torch.randn(8, 8, generator=torch.Generator().manual_seed(10), dtype=torch.float64)

    def hidden_of(w: Tensor) -> Tensor:
        return torch.tanh(torch.nn.functional.embedding(ids, w) @ mix)

    w = weight.clone().requires_grad_()
    out = fused_head_logprobs(hidden_of(w), w, target, temperature=1.1, chunk_size=4)
    (gw,) = _grads((out.logprobs, out.entropy), (w,), w1, w2)
    wr = weight.clone().requires_grad_()
    ref_lp, ref_h = reference(hidden_of(wr) @ wr.t(), target, 1.1)
    (ref_gw,) = _grads((ref_lp, ref_h), (wr,), w1, w2)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(gw, ref_gw, atol=1e-12, rtol=0)
    lookup_rows = torch.zeros(30, dtype=torch.bool)
    lookup_rows[ids] = True
    assert float(gw[lookup_rows].abs().min()) > 0 and float(gw[~lookup_rows].abs().min()) > 0


@pytest.mark.parametrize("which", ["logp_only", "entropy_only", "no_entropy"])
def test_partial_outputs(which: str) -> None:
    hidden, weight, target, w1, w2 = make_head(11, 6, 17, torch.float64, seed=4)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_head_logprobs(h, w, target, temperature=1.3, chunk_size=3, with_entropy=which != "no_entropy")
    assert (out.entropy is None) == (which == "no_entropy")
    use_lp, use_h = which != "entropy_only", which == "entropy_only"
    got = _grads((out.logprobs * use_lp, out.entropy if use_h else None), (h, w), w1, w2)
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_h = reference(hr @ wr.t(), target, 1.3)
    want = _grads((ref_lp * use_lp, ref_h if use_h else None), (hr, wr), w1, w2)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
        assert float(g.abs().sum()) > 0


def test_frozen_weight_gets_no_gradient_and_leading_dims_are_kept() -> None:
    """A frozen output layer (LoRA's base): only the hidden states' gradient is computed."""
    hidden, weight, target, w1, w2 = make_head(12, 4, 9, torch.float64, seed=5)
    h = hidden.clone().reshape(3, 4, 4).requires_grad_()
    out = fused_head_logprobs(h, weight, target.reshape(3, 4), chunk_size=5)
    assert out.logprobs.shape == (3, 4) and out.entropy is not None and out.entropy.shape == (3, 4)
    (gh,) = _grads((out.logprobs.reshape(-1), out.entropy.reshape(-1)), (h,), w1, w2)
    _, _, ref_gh, _ = _reference(hidden, weight, target, 1.0, w1, w2)
    torch.testing.assert_close(gh.reshape(12, 4), ref_gh, atol=1e-12, rtol=0)


def test_weight_gradient_into_main_grad() -> None:
    """Megatron's convention: added to `main_grad` (over micro-batches too), flagged for DDP's hook."""
    hidden, weight, target, w1, w2 = make_head(10, 4, 12, torch.float32, seed=6)
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = torch.full(weight.shape, 0.5)       # type: ignore[attr-defined]
    w.grad_added_to_main_grad = False                # type: ignore[attr-defined]
    for _ in range(2):
        out = fused_head_logprobs(hidden, w, target, chunk_size=3, into_main_grad=True)
        ((out.logprobs.double() * w1).sum() + (out.entropy.double() * w2).sum()).backward()
    assert w.grad_added_to_main_grad                 # type: ignore[attr-defined]
    _, _, _, ref_gw = _reference(hidden, weight, target, 1.0, w1, w2)
    torch.testing.assert_close(w.main_grad.double(), 0.5 + 2 * ref_gw, atol=1e-5, rtol=0)  # type: ignore[attr-defined]


def test_the_placeholder_gradient_follows_megatrons_linear() -> None:
    """GPU audit 6 #5: a `zero_out_wgrad` weight gets a zero placeholder (DDP adds `grad` to
    `main_grad` anyway, megatron's linear does the same); `main_grad` gets the gradient either way."""
    hidden, weight, target, w1, w2 = make_head(10, 4, 12, torch.float32, seed=6)
    _, _, _, ref_gw = _reference(hidden, weight, target, 1.0, w1, w2)
    for zero in (True, False):
        w = torch.nn.Parameter(weight.clone())
        w.main_grad = torch.zeros(weight.shape)          # type: ignore[attr-defined]
        w.grad_added_to_main_grad, w.zero_out_wgrad = False, zero   # type: ignore[attr-defined]
        out = fused_head_logprobs(hidden, w, target, chunk_size=3, into_main_grad=True)
        ((out.logprobs.double() * w1).sum() + (out.entropy.double() * w2).sum()).backward()
        assert w.grad is not None and w.grad_added_to_main_grad    # type: ignore[attr-defined]
        if zero:
            assert not w.grad.any()
        torch.testing.assert_close(w.main_grad.double(), ref_gw, atol=1e-5, rtol=0)  # type: ignore[attr-defined]


class _Sizes(TorchDispatchMode):
    """The element count of every tensor any op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: object, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        out = func(*args, **(kwargs or {}))    # type: ignore[operator]
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("into_main_grad", [False, True])
def test_no_tokens_by_vocab_tensor_forward_or_backward(into_main_grad: bool) -> None:
    """64 tokens × 50 vocabulary: the largest tensor made is a weight-sized buffer or [tokens,
    hidden], never [tokens, vocab] (3,200), with or without `main_grad`."""
    n, hid, v = 64, 8, 50
    hidden, weight, target, w1, w2 = make_head(n, hid, v, torch.float32, seed=7)
    h, w = hidden.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    if into_main_grad:
        w.main_grad = torch.zeros(v, hid)            # type: ignore[attr-defined]
    with _Sizes() as sizes:
        out = fused_head_logprobs(h, w, target, chunk_size=4, into_main_grad=into_main_grad)
        ((out.logprobs * w1.float()).sum() + (out.entropy * w2.float()).sum()).backward()
    assert sizes.largest <= max(n * hid, v * hid) < n * v
    assert h.grad is not None and w.grad is not None


def test_rejects_bad_arguments() -> None:
    hidden, weight, target, _, _ = make_head(4, 3, 5, torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        fused_head_logprobs(hidden, weight, target, temperature=0.0)
    with pytest.raises(ValueError, match="do not fit"):
        fused_head_logprobs(hidden, weight.t().contiguous(), target)
    with pytest.raises(ValueError, match="do not fit"):
        fused_head_logprobs(hidden, weight, target[:3])
