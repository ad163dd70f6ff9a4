"""Per-token log-probs and entropy from the last hidden states: the LM head fused into the chunked pass.

Input: hidden states ``[tokens, hidden]`` (every token of the micro-batch: under sequence
parallelism the caller gathers them first, as megatron-core's output layer does), this rank's
output-layer weight shard ``[vocab/TP, hidden]`` (the word embeddings when they are tied), the
target ids ``[tokens]`` (global ids), the TP group and the temperature T. Output: what
`logprobs.vocab_parallel_logprobs` returns for ``logits = hidden @ weight.T``, without those logits.

Memory: no ``[tokens, vocab/TP]`` tensor exists at any time. Each chunk of rows computes its logits
``[chunk, vocab/TP]`` in the weight's dtype (the output layer's GEMM), runs the chunked pass of
`logprobs.py` on them (the same two all-reduces per chunk) and drops them; only per-token vectors
are saved. Backward recomputes each chunk's logits, turns them into the gradient of those logits
(`logprobs._backward_chunk`, in the logits' dtype as the unfused path's gradient is) and multiplies
it out at once: ``∂hidden[chunk] = g @ W`` (complete per chunk) and ``∂W += gᵀ @ hidden[chunk]``.
The weight gradient is accumulated in float32 (vocabulary tiles of a bf16 GEMM each), into
megatron's ``main_grad`` when the caller allows it (``into_main_grad``: what megatron's gradient-
accumulation fusion does, `tensor_parallel/layers.py`; never for tied embeddings, whose other
use's gradient DDP would then skip), else into a float32 buffer of the weight's shape returned as
the gradient. The gradient of the hidden states is a partial sum over this rank's vocabulary: the
caller's TP mapping (megatron's) all-reduces or reduce-scatters it, as for the output layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .logprobs import (
    DEFAULT_CHUNK_BYTES,
    LogProbOutput,
    _backward_chunk,
    _forward_chunk,
    _forward_rows,
    _tp_rank_world,
)


def default_chunk_rows(local_vocab: int) -> int:
    """Rows whose float32 ``[rows, vocab/TP]`` temporary fits ``DEFAULT_CHUNK_BYTES`` (the chunked
    path's rule, so both paths hold the same temporaries)."""
    return max(1, DEFAULT_CHUNK_BYTES // (local_vocab * 4))


def _add_weight_grad(acc: Tensor, grad_logits: Tensor, hidden: Tensor) -> None:
    """``acc += grad_logitsᵀ @ hidden``. Same dtypes: one GEMM into ``acc``. A float32 accumulator
    with bf16 operands: vocabulary tiles of one bf16 GEMM each (a ``[tile, hidden]`` temporary no
    larger than a logits chunk), so the GEMMs keep the model's dtype and the sum does not."""
    if acc.dtype == grad_logits.dtype == hidden.dtype:
        acc.addmm_(grad_logits.t(), hidden)
        return
    tile = max(1, DEFAULT_CHUNK_BYTES // (hidden.shape[-1] * 4))
    for s in range(0, acc.shape[0], tile):
        acc[s:s + tile].add_(grad_logits[:, s:s + tile].t() @ hidden)


def _chunk_buffers(hidden: Tensor, weight: Tensor, chunk_size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The two ``[chunk, vocab/TP]`` buffers every chunk reuses: the logits (weight's dtype) and
    ``exp``'s output (compute dtype). Reused rather than allocated per chunk: on the CPU a fresh
    allocation this large is page-faulted in on every chunk, a cost of the order of ``exp`` itself."""
    rows = min(chunk_size, hidden.shape[0])
    return (hidden.new_empty(rows, weight.shape[0], dtype=weight.dtype),
            hidden.new_empty(rows, weight.shape[0], dtype=dtype))


class _FusedHead(torch.autograd.Function):
    """hidden, weight → (log p_target, entropy), chunked over rows, recomputing in backward."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, target: Tensor, vocab_start: int, temperature: float,
        group: dist.ProcessGroup | None, chunk_size: int, with_entropy: bool, into_main_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        dtype = torch.promote_types(weight.dtype, torch.float32)
        buf, scratch = _chunk_buffers(hidden, weight, chunk_size, dtype)

        def chunk(rows: slice) -> tuple[Tensor, Tensor, Tensor | None]:
            logits = torch.matmul(hidden[rows], weight.t(), out=buf[:hidden[rows].shape[0]])
            return _forward_chunk(logits, target[rows], vocab_start, temperature, group, with_entropy, dtype,
                                  own_chunk=True, scratch=scratch)

        logp, lse, entropy = _forward_rows(hidden.shape[0], chunk_size, hidden, dtype, chunk)
        ctx.save_for_backward(hidden, weight, target, lse, entropy)
        ctx.args = (vocab_start, temperature, chunk_size, with_entropy, dtype, into_main_grad)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, target, lse, entropy = ctx.saved_tensors
        vocab_start, temperature, chunk_size, with_entropy, dtype, into_main_grad = ctx.args
        none = (None,) * 7
        grad_entropy = grad_entropy if with_entropy else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w):
            return (None, None) + none
        grad_h = torch.empty_like(hidden) if need_h else None
        main_grad = getattr(weight, "main_grad", None) if into_main_grad else None
        acc = None if not need_w else main_grad if main_grad is not None else \
            torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        buf, scratch = _chunk_buffers(hidden, weight, chunk_size, dtype)
        for s in range(0, hidden.shape[0], chunk_size):
            rows = slice(s, s + chunk_size)
            h = hidden[rows]
            logits = torch.matmul(h, weight.t(), out=buf[:h.shape[0]])
            _backward_chunk(
                logits, target[rows], vocab_start, temperature, lse[rows],
                entropy[rows] if grad_entropy is not None else None,
                None if grad_logp is None else grad_logp[rows].to(dtype),
                None if grad_entropy is None else grad_entropy[rows].to(dtype),
                logits, scratch,    # the gradient overwrites the recomputed logits: one chunk buffer fewer
            )
            if grad_h is not None:
                torch.matmul(logits, weight, out=grad_h[rows])
            if acc is not None:
                _add_weight_grad(acc, logits, h)
        return (grad_h, _weight_grad(weight, acc, main_grad)) + none


def _weight_grad(weight: Tensor, acc: Tensor | None, main_grad: Tensor | None) -> Tensor | None:
    """What autograd gets for the weight. Accumulated into ``main_grad``: an unused placeholder of
    the weight's shape (autograd needs one for DDP's hook to run) and the flag that tells DDP's hook
    the gradient is already in ``main_grad`` (megatron's convention, reset by `zero_grad_buffer`)."""
    if acc is None:
        return None
    if main_grad is not None:
        weight.grad_added_to_main_grad = True   # type: ignore[attr-defined]
        # As megatron's linear (tensor_parallel/layers.py:697): DDP adds a `zero_out_wgrad` weight's
        # `grad` to `main_grad` anyway, so its placeholder must be zeros.
        if getattr(weight, "zero_out_wgrad", False):
            return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
        return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return acc if acc.dtype == weight.dtype else acc.to(weight.dtype)


def fused_head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    into_main_grad: bool = False,
) -> LogProbOutput:
    """Log-prob of ``target`` and entropy under softmax(hidden @ weight.T / temperature).

    ``hidden``: ``[..., hidden]`` (the leading dims are flattened and must match ``target``'s);
    ``weight``: this rank's ``[vocab/TP, hidden]`` shard, whose first global id is ``vocab_start``
    (default ``rank · vocab/TP``). ``chunk_size``: rows per chunk (None: `default_chunk_rows`).
    ``into_main_grad``: accumulate the weight's gradient into ``weight.main_grad`` when it has one
    (a DDP-wrapped, untied output layer). Returns tensors shaped like ``target``; ``entropy`` is None
    unless requested."""
    local_vocab = weight.shape[0]
    chunk_size = default_chunk_rows(local_vocab) if chunk_size is None else chunk_size
    if temperature <= 0 or chunk_size < 1:
        raise ValueError("temperature must be > 0 and chunk_size >= 1")
    if hidden.shape[-1] != weight.shape[-1] or hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and target "
                         f"{tuple(target.shape)} do not fit: [..., H], [V/TP, H] and [...] expected")
    rank, _ = _tp_rank_world(tp_group)
    start = rank * local_vocab if vocab_start is None else vocab_start
    logp, entropy = _FusedHead.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), start, float(temperature), tp_group,
        int(chunk_size), with_entropy, into_main_grad,
    )
    return LogProbOutput(logp.reshape(target.shape), entropy.reshape(target.shape) if with_entropy else None)
