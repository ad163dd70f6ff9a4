"""Chunked (vocab-parallel) log-probs and entropy vs a float64 log_softmax reference."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from megatron_rl.logprobs import vocab_parallel_logprobs
from tests.helpers.logprobs import make, objective_grads, reference


@pytest.mark.parametrize("chunk_size", [1, 5, 7, 64, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float64_matches_reference(chunk_size: int | None, temperature: float) -> None:
    logits, target, w1, w2 = make(23, 41, torch.float64)  # 23 rows: 5 and 7 do not divide them
    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(x, target, temperature=temperature, chunk_size=chunk_size)
    xr = logits.clone().requires_grad_()
    ref_lp, ref_h = reference(xr, target, temperature)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.entropy, ref_h, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        objective_grads(x, out.logprobs, out.entropy, w1, w2), objective_grads(xr, ref_lp, ref_h, w1, w2),
        atol=1e-12, rtol=0,
    )


def test_float32_within_1e5_of_float64_reference() -> None:
    logits, target, w1, w2 = make(37, 300, torch.float32, seed=1)
    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(x, target, temperature=0.8, chunk_size=10)
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    xr = logits.double().requires_grad_()
    ref_lp, ref_h = reference(xr, target, 0.8)
    torch.testing.assert_close(out.logprobs.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ref_h, atol=1e-5, rtol=0)
    g = objective_grads(x, out.logprobs, out.entropy, w1, w2)
    assert g.dtype == torch.float32
    torch.testing.assert_close(g.double(), objective_grads(xr, ref_lp, ref_h, w1, w2), atol=1e-5, rtol=0)


def test_bfloat16_logits_give_float32_outputs_and_bf16_grad() -> None:
    logits, target, w1, w2 = make(19, 64, torch.bfloat16, seed=2)
    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(x, target, chunk_size=4)
    xr = logits.double().requires_grad_()
    ref_lp, ref_h = reference(xr, target, 1.0)
    torch.testing.assert_close(out.logprobs.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ref_h, atol=1e-5, rtol=0)
    g = objective_grads(x, out.logprobs, out.entropy, w1, w2)
    assert g.dtype == torch.bfloat16
    torch.testing.assert_close(g.double(), objective_grads(xr, ref_lp, ref_h, w1, w2), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("which", ["logp_only", "entropy_only", "no_entropy"])
def test_partial_outputs(which: str) -> None:
    logits, target, w1, w2 = make(11, 17, torch.float64, seed=3)
    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(x, target, temperature=1.3, chunk_size=3, with_entropy=which != "no_entropy")
    xr = logits.clone().requires_grad_()
    ref_lp, ref_h = reference(xr, target, 1.3)
    if which == "no_entropy":
        assert out.entropy is None
    use_lp, use_h = which != "entropy_only", which == "entropy_only"
    got = objective_grads(x, out.logprobs * use_lp, out.entropy if use_h else None, w1, w2)
    want = objective_grads(xr, ref_lp * use_lp, ref_h if use_h else None, w1, w2)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert float(got.abs().sum()) > 0


def test_leading_dims_and_masked_vocabulary() -> None:
    logits, target, w1, w2 = make(12, 9, torch.float64, seed=4)
    logits[:, -2:] = float("-inf")  # padded vocabulary entries
    target = target % 7
    x = logits.clone().reshape(3, 4, 9).requires_grad_()
    out = vocab_parallel_logprobs(x, target.reshape(3, 4), chunk_size=5)
    assert out.logprobs.shape == (3, 4) and out.entropy.shape == (3, 4)
    xr = logits[:, :7].clone().requires_grad_()
    ref_lp, ref_h = reference(xr, target, 1.0)
    torch.testing.assert_close(out.logprobs.reshape(-1), ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.entropy.reshape(-1), ref_h, atol=1e-12, rtol=0)
    g = objective_grads(x, out.logprobs.reshape(-1), out.entropy.reshape(-1), w1, w2).reshape(12, 9)
    assert torch.all(g[:, 7:] == 0)
    torch.testing.assert_close(g[:, :7], objective_grads(xr, ref_lp, ref_h, w1, w2), atol=1e-12, rtol=0)


def test_backward_saves_no_vocab_sized_intermediates() -> None:
    """Only the logits themselves and per-token vectors are kept for backward."""
    n, v = 16, 50
    logits, target, _, _ = make(n, v, torch.float32, seed=5)
    x = logits.clone().requires_grad_()
    saved: list[int] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t.numel() if t.data_ptr() != x.data_ptr() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_logprobs(x, target, chunk_size=4)
    assert saved and max(saved) <= n  # nothing [tokens, vocab]-sized besides the input


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        vocab_parallel_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError):
        vocab_parallel_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_size=0)


# ------------------------------------------------------------- TP=2 (gloo)

TP_N, TP_V, TP_T, TP_CHUNK = 13, 30, 0.9, 5


def _tp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        logits, target, w1, w2 = make(TP_N, TP_V, torch.float32, seed=6)
        shard = TP_V // world
        x = logits[:, rank * shard:(rank + 1) * shard].clone().requires_grad_()
        out = vocab_parallel_logprobs(x, target, tp_group=dist.group.WORLD, temperature=TP_T, chunk_size=TP_CHUNK)
        g = objective_grads(x, out.logprobs, out.entropy, w1, w2)
        torch.save({"logp": out.logprobs, "entropy": out.entropy, "grad": g}, os.path.join(out_dir, f"{rank}.pt"))
        fused = {sp: _fused_tp_case(rank, world, sp) for sp in (False, True)}
        torch.save(fused, os.path.join(out_dir, f"fused{rank}.pt"))
    finally:
        dist.destroy_process_group()


# The fused head at TP 2 in the same launch: hidden [S, B, H] (sequence-sharded under SP) gathered by
# the actor's `gather_for_head` (megatron-core's mappings), the weight's vocabulary shards.
FUSED_S, FUSED_B, FUSED_H = 8, 2, 8


def _fused_tp_case(rank: int, world: int, sp: bool) -> dict[str, Tensor]:
    from types import SimpleNamespace

    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()
    from megatron_rl.fused_head import fused_head_logprobs
    from megatron_rl.megatron.head import gather_for_head
    from tests.helpers.logprobs import make_head

    hidden, weight, target, w1, w2 = make_head(FUSED_S * FUSED_B, FUSED_H, TP_V, torch.float32, seed=8)
    shard, rows = TP_V // world, FUSED_S // world
    w = weight[rank * shard:(rank + 1) * shard].clone().requires_grad_()
    full = hidden.reshape(FUSED_S, FUSED_B, FUSED_H)
    h = (full[rank * rows:(rank + 1) * rows] if sp else full).clone().requires_grad_()
    layer = SimpleNamespace(tp_group=dist.group.WORLD, sequence_parallel=sp)
    out = fused_head_logprobs(gather_for_head(h, layer), w, target.reshape(FUSED_S, FUSED_B), dist.group.WORLD,
                              temperature=TP_T, chunk_size=TP_CHUNK)
    assert out.entropy is not None
    loss = (out.logprobs.double().reshape(-1) * w1).sum() + (out.entropy.double().reshape(-1) * w2).sum()
    loss.backward()
    return {"logp": out.logprobs.reshape(-1), "entropy": out.entropy.reshape(-1), "grad_h": h.grad, "grad_w": w.grad}


def test_tensor_parallel_two_ranks_match_single_process() -> None:
    logits, target, w1, w2 = make(TP_N, TP_V, torch.float32, seed=6)
    assert {int(t) < TP_V // 2 for t in target} == {True, False}  # targets on both shards
    xr = logits.double().requires_grad_()
    ref_lp, ref_h = reference(xr, target, TP_T)
    ref_g = objective_grads(xr, ref_lp, ref_h, w1, w2)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_tp_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]
        fused = [torch.load(os.path.join(tmp, f"fused{r}.pt")) for r in range(2)]
    for r in results:
        torch.testing.assert_close(r["logp"].double(), ref_lp, atol=1e-6, rtol=0)
        torch.testing.assert_close(r["entropy"].double(), ref_h, atol=1e-6, rtol=0)
    grad = torch.cat([r["grad"] for r in results], dim=-1)
    torch.testing.assert_close(grad.double(), ref_g, atol=1e-6, rtol=0)
    _check_fused_tp(fused)


def _check_fused_tp(results: list[dict[bool, dict[str, Tensor]]]) -> None:
    """float64 reference through full logits; fp32 tolerances: 1e-6 absolute + relative on log-probs
    and entropy (the logits are an fp32 GEMM: log-probs of ~13 nats measured 1.2e-6 off), 1e-5 of the
    largest entry on the gradients (sums over 16 tokens or 30 vocabulary entries)."""
    from tests.helpers.logprobs import make_head

    hidden, weight, target, w1, w2 = make_head(FUSED_S * FUSED_B, FUSED_H, TP_V, torch.float32, seed=8)
    assert {int(t) < TP_V // 2 for t in target} == {True, False}   # targets on both shards
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, ref_h = reference(h @ w.t(), target, TP_T)
    ref_gh, ref_gw = torch.autograd.grad((ref_lp * w1).sum() + (ref_h * w2).sum(), (h, w))
    ref_gh = ref_gh.reshape(FUSED_S, FUSED_B, FUSED_H)
    rows = FUSED_S // 2
    for sp in (False, True):
        for rank, r in enumerate(results):
            got = r[sp]
            torch.testing.assert_close(got["logp"].double(), ref_lp, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(got["entropy"].double(), ref_h, atol=1e-6, rtol=1e-6)
            want_h = ref_gh[rank * rows:(rank + 1) * rows] if sp else ref_gh   # reduce-scattered / all-reduced
            torch.testing.assert_close(got["grad_h"].double(), want_h, atol=1e-5 * float(ref_gh.abs().max()), rtol=0)
        grad_w = torch.cat([r[sp]["grad_w"] for r in results])
        torch.testing.assert_close(grad_w.double(), ref_gw, atol=1e-5 * float(ref_gw.abs().max()), rtol=0)


# -------------------------------------------------------------------- GPU


