"""Transformer Engine's fused log-probs on bf16 logits, TP 1 and TP 2 (NCCL), against a float64
log_softmax of the same bf16 values. Both paths compute in fp32 on exact bf16 inputs, so log-probs
and entropy must agree within 1e-3 nat; gradients come out in bf16 (relative step 2^-8), hence
rtol 1e-2. At T != 1 the division by T must not round in bf16 first (audit #16).

TE's kernel runs only without entropy (`with_entropy=False`: π_old, π_ref, the verification), so
each test calls that form too and checks that TE ran (`_te_disabled` stays False: any TE error
falls back to the torch path and sets it); with entropy the chunked torch path runs."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl import logprobs as logprobs_module
from megatron_rl.logprobs import vocab_parallel_logprobs
from tests.helpers.logprobs import make, objective_grads, reference

pytestmark = pytest.mark.gpu
ROWS, VOCAB = 512, 32768
ATOL_NAT = 1e-3


def _check(out_lp: torch.Tensor, out_h: torch.Tensor, grad: torch.Tensor, logits: torch.Tensor,
           target: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, temperature: float) -> None:
    xr = logits.double().requires_grad_()
    ref_lp, ref_h = reference(xr, target, temperature)
    ref_g = objective_grads(xr, ref_lp, ref_h, w1, w2)
    torch.testing.assert_close(out_lp.double().cpu(), ref_lp.detach(), atol=ATOL_NAT, rtol=0)
    torch.testing.assert_close(out_h.double().cpu(), ref_h.detach(), atol=ATOL_NAT, rtol=0)
    torch.testing.assert_close(grad.double().cpu(), ref_g, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_te_bf16_tp1_matches_float64(temperature: float) -> None:
    pytest.importorskip("transformer_engine.pytorch")
    logits, target, w1, w2 = make(ROWS, VOCAB, torch.bfloat16, seed=3)
    x = logits.cuda().requires_grad_()
    out = vocab_parallel_logprobs(x, target.cuda(), temperature=temperature, use_te=True)
    assert out.logprobs.device.type == "cuda" and out.logprobs.dtype == torch.float32
    grad = objective_grads(x, out.logprobs, out.entropy, w1.cuda(), w2.cuda())
    assert grad.dtype == torch.bfloat16
    _check(out.logprobs, out.entropy, grad, logits, target, w1, w2, temperature)
    te = vocab_parallel_logprobs(x, target.cuda(), temperature=temperature, with_entropy=False, use_te=True)
    assert not logprobs_module._te_disabled and te.entropy is None         # TE's kernel ran
    _check_te(te.logprobs, objective_grads(x, te.logprobs, None, w1.cuda(), w2.cuda()), logits, target, w1,
              temperature)


def _check_te(out_lp: torch.Tensor, grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
              w1: torch.Tensor, temperature: float) -> None:
    xr = logits.double().requires_grad_()
    ref_lp, _ = reference(xr, target, temperature)
    torch.testing.assert_close(out_lp.double().cpu(), ref_lp.detach(), atol=ATOL_NAT, rtol=0)
    torch.testing.assert_close(grad.double().cpu(), objective_grads(xr, ref_lp, None, w1, w1), atol=1e-3, rtol=1e-2)


def _tp2_worker(rank: int, init_file: str, out_dir: str, temperature: float) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    try:
        logits, target, w1, w2 = make(ROWS, VOCAB, torch.bfloat16, seed=5)
        shard = VOCAB // 2
        x = logits[:, rank * shard:(rank + 1) * shard].contiguous().cuda().requires_grad_()
        out = vocab_parallel_logprobs(x, target.cuda(), tp_group=dist.group.WORLD, temperature=temperature,
                                      use_te=True)
        grad = objective_grads(x, out.logprobs, out.entropy, w1.cuda(), w2.cuda())
        te = vocab_parallel_logprobs(x, target.cuda(), tp_group=dist.group.WORLD, temperature=temperature,
                                     with_entropy=False, use_te=True)
        te_grad = objective_grads(x, te.logprobs, None, w1.cuda(), w2.cuda())
        torch.save({"logp": out.logprobs.cpu(), "entropy": out.entropy.cpu(), "grad": grad.cpu(),
                    "te_logp": te.logprobs.cpu(), "te_grad": te_grad.cpu(), "te_ran": not logprobs_module._te_disabled},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_te_bf16_tp2_matches_float64(temperature: float) -> None:
    pytest.importorskip("transformer_engine.pytorch")
    if torch.cuda.device_count() < 2:
        pytest.skip("TP 2 over NCCL needs 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_tp2_worker, args=(os.path.join(tmp, "init"), tmp, temperature), nprocs=2, join=True)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]
    logits, target, w1, w2 = make(ROWS, VOCAB, torch.bfloat16, seed=5)
    grad = torch.cat([r["grad"] for r in results], dim=-1)
    for r in results:        # every TP rank holds the full rows' log-probs and entropy
        _check(r["logp"], r["entropy"], grad, logits, target, w1, w2, temperature)
    te_grad = torch.cat([r["te_grad"] for r in results], dim=-1)
    for r in results:
        assert r["te_ran"]
        _check_te(r["te_logp"], te_grad, logits, target, w1, temperature)


@pytest.mark.gpu
def test_cuda_te_and_torch_paths_agree() -> None:
    """On CUDA: the torch path matches the reference; TE (when installed) matches the torch path."""
    logits, target, w1, w2 = make(257, 5003, torch.float32, seed=7)
    x = logits.cuda().requires_grad_()
    t = target.cuda()
    torch_out = vocab_parallel_logprobs(x, t, temperature=0.7, chunk_size=64, use_te=False)
    ref_lp, ref_h = reference(logits, target, 0.7)
    torch.testing.assert_close(torch_out.logprobs.double().cpu(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch_out.entropy.double().cpu(), ref_h, atol=1e-5, rtol=0)
    g_torch = objective_grads(x, torch_out.logprobs, torch_out.entropy, w1.cuda(), w2.cuda())
    pytest.importorskip("transformer_engine.pytorch")
    te_out = vocab_parallel_logprobs(x, t, temperature=0.7, use_te=True)
    torch.testing.assert_close(te_out.logprobs, torch_out.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(te_out.entropy, torch_out.entropy, atol=1e-5, rtol=0)
    g_te = objective_grads(x, te_out.logprobs, te_out.entropy, w1.cuda(), w2.cuda())
    torch.testing.assert_close(g_te, g_torch, atol=1e-5, rtol=0)
    torch.testing.assert_close(x, logits.cuda())  # TE must not have overwritten the logits
    # TE's fused kernel itself: only without entropy (what π_old, π_ref and the verification call).
    from megatron_rl import logprobs as logprobs_module

    te_only = vocab_parallel_logprobs(x, t, temperature=0.7, with_entropy=False, use_te=True)
    assert not logprobs_module._te_disabled and te_only.entropy is None
    torch.testing.assert_close(te_only.logprobs, torch_out.logprobs, atol=1e-5, rtol=0)
    g_only = objective_grads(x, te_only.logprobs, None, w1.cuda(), w2.cuda())
    torch_only = vocab_parallel_logprobs(x, t, temperature=0.7, with_entropy=False, use_te=False)
    torch.testing.assert_close(g_only, objective_grads(x, torch_only.logprobs, None, w1.cuda(), w2.cuda()),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(x, logits.cuda())
