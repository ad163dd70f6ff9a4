"""Per-token log-probs and entropy from (vocab-parallel) logits, chunked over tokens.

Input: a logits shard ``[tokens, vocab/TP]`` (any leading dims are flattened), the
target ids ``[tokens]`` (global vocabulary ids), the TP process group (None = no
TP) and the sampling temperature T of the behaviour policy (logits / T, matching
the rollout engine). Output: float32 (float64 for float64 logits) log-prob of
each target and the entropy of the tempered distribution.

Memory: a full ``[tokens, vocab]`` float32 softmax is never materialized. Rows are processed
``chunk_size`` at a time (default: as many as fit one ``DEFAULT_CHUNK_BYTES`` temporary) with two
float32 ``[chunk, vocab/TP]`` temporaries in forward and one in backward (for float32 logits);
backward recomputes the softmax per chunk from the saved logits and the saved per-token log-sum-exp,
so the only full-size buffer is the gradient itself. Under TP each chunk needs two all-reduces (MAX
of the row maxima, SUM of [Σexp, Σexp·logit, target logit] — the target logit is contributed by the
owning rank only); backward needs none, because the saved log-sum-exp and entropy are already global
and every rank owns its slice of the gradient.

Gradients (z = logits / T, p = softmax(z)):
  ∂ log p_y / ∂z = onehot(y) − p
  ∂ H / ∂z       = −p ⊙ (log p + H)
each divided by T for the raw logits. Entropy is differentiable because the
entropy bonus of the objectives trains through it.

Transformer-Engine: when ``transformer_engine`` imports and the logits are on CUDA
(and the shards are equal, as TE assumes), the target log-prob comes from TE's
fused ``parallel_cross_entropy`` kernel, when entropy is not requested (with entropy the
chunked torch pass yields both). TE receives a fresh float32 ``logits / T`` buffer,
because some TE versions write the gradient into their input in place. Older TE
versions reject TP > 1 with an assertion; we then fall back to the torch path
for the rest of the process (with a warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

# Default budget of one float32 [chunk, vocab/TP] temporary: 128 MiB is ~220 rows of
# a 152k vocabulary at TP=1 — large enough to keep GPU kernels efficient, small
# next to the [tokens, vocab] gradient that backward must produce anyway.
DEFAULT_CHUNK_BYTES = 128 * 2**20
_te_disabled = False


class LogProbOutput(NamedTuple):
    logprobs: Tensor
    entropy: Tensor | None


def _all_reduce(t: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _tempered(chunk: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    # Always a fresh compute-dtype buffer (one, also for bf16 input), so the in-place
    # steps that follow never touch the logits.
    return chunk.to(dtype, copy=True).div_(temperature)


def _target_index(target: Tensor, vocab_start: int, local_vocab: int) -> tuple[Tensor, Tensor]:
    """(clamped local index, owned-by-this-rank flag) of each target id."""
    local = target - vocab_start
    owned = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), owned


def _forward_chunk(
    chunk: Tensor, target: Tensor, vocab_start: int, temperature: float,
    group: dist.ProcessGroup | None, with_entropy: bool, dtype: torch.dtype,
    own_chunk: bool = False, scratch: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(log p_target, log-sum-exp, entropy) for one chunk of rows.

    ``own_chunk``: the chunk is the caller's scratch (the fused head's recomputed logits), so a
    compute-dtype chunk is tempered in place instead of copied. ``scratch``: a reused buffer of at
    least the chunk's rows for ``exp`` (a fresh CPU allocation this large costs page faults on every
    chunk, more than the ``exp`` itself)."""
    if own_chunk and chunk.dtype == dtype:
        z = chunk if temperature == 1.0 else chunk.div_(temperature)
    else:
        z = _tempered(chunk, temperature, dtype)
    row_max = _all_reduce(z.amax(dim=-1), dist.ReduceOp.MAX, group)
    z.sub_(row_max.unsqueeze(-1))
    index, owned = _target_index(target, vocab_start, z.shape[-1])
    target_z = torch.where(owned, z.gather(-1, index.unsqueeze(-1)).squeeze(-1), 0.0)
    e = z.exp() if scratch is None else torch.exp(z, out=scratch[:z.shape[0]])
    sum_exp = e.sum(dim=-1)
    # 0·(−inf) from −inf logits (masked vocabulary) is NaN; such entries contribute 0.
    e_dot_z = e.mul_(z).nan_to_num_(nan=0.0).sum(dim=-1) if with_entropy else torch.zeros_like(sum_exp)
    stats = _all_reduce(torch.stack([sum_exp, e_dot_z, target_z]), dist.ReduceOp.SUM, group)
    log_sum = stats[0].log()
    logp = stats[2] - log_sum
    entropy = log_sum - stats[1] / stats[0] if with_entropy else None
    return logp, row_max + log_sum, entropy


ChunkFn = Callable[[slice], "tuple[Tensor, Tensor, Tensor | None]"]


def _forward_rows(n: int, chunk_size: int, like: Tensor, dtype: torch.dtype, chunk_fn: ChunkFn) -> tuple[Tensor, ...]:
    """(log p, log-sum-exp, entropy) of ``n`` rows, ``chunk_fn(rows)`` giving each chunk's (the loop
    both the chunked path and the fused head run)."""
    logp = like.new_empty(n, dtype=dtype)
    lse = like.new_empty(n, dtype=dtype)
    entropy = like.new_zeros(n, dtype=dtype)
    for s in range(0, n, chunk_size):
        rows = slice(s, s + chunk_size)
        lp, ls, ent = chunk_fn(rows)
        logp[rows], lse[rows] = lp, ls
        if ent is not None:
            entropy[rows] = ent
    return logp, lse, entropy


def _backward_chunk(
    chunk: Tensor, target: Tensor, vocab_start: int, temperature: float, lse: Tensor,
    entropy: Tensor | None, grad_logp: Tensor | None, grad_entropy: Tensor | None, out: Tensor,
    scratch: Tensor | None = None,
) -> None:
    """Write the gradient w.r.t. one chunk of raw logits into ``out``, recomputing the softmax.

    When ``out`` already has the compute dtype it doubles as the work buffer, so
    float32 logits need a single chunk-sized temporary (``p``, in ``scratch`` when given: a reused
    buffer of at least the chunk's rows) in backward. The signs and ``1/T`` are folded into per-row
    factors, so each [chunk, vocab/TP] pass does one thing the gradient needs.
    """
    dtype = lse.dtype
    work = out if out.dtype == dtype else torch.empty(out.shape, dtype=dtype, device=out.device)
    if work.data_ptr() != chunk.data_ptr():
        work.copy_(chunk)
    log_p = (work if temperature == 1.0 else work.div_(temperature)).sub_(lse.unsqueeze(-1))
    p = log_p.exp() if scratch is None else torch.exp(log_p, out=scratch[:log_p.shape[0]])
    g_logp = grad_logp if grad_logp is not None else torch.zeros_like(lse)
    if grad_entropy is not None and entropy is not None:
        # −p·(g_logp + g_H·(log p + H))/T = p·(a·log p + b); NaN only arises as 0·(−inf) for −inf logits.
        a = grad_entropy.div(-temperature).unsqueeze(-1)
        b = (g_logp + grad_entropy * entropy).div_(-temperature).unsqueeze(-1)
        work = log_p.mul_(a).add_(b).mul_(p).nan_to_num_(nan=0.0)
    else:
        work = torch.mul(p, g_logp.div(-temperature).unsqueeze(-1), out=log_p)
    del p
    index, owned = _target_index(target, vocab_start, work.shape[-1])
    work.scatter_add_(-1, index.unsqueeze(-1), torch.where(owned, g_logp / temperature, 0.0).unsqueeze(-1))
    if work.data_ptr() != out.data_ptr():
        out.copy_(work)


class _ChunkedLogProbs(torch.autograd.Function):
    """autograd wrapper around the chunked forward/backward above."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, target: Tensor, vocab_start: int, temperature: float,
        group: dist.ProcessGroup | None, chunk_size: int, with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logp, lse, entropy = _forward_rows(logits.shape[0], chunk_size, logits, dtype, lambda rows: _forward_chunk(
            logits[rows], target[rows], vocab_start, temperature, group, with_entropy, dtype))
        ctx.save_for_backward(logits, target, lse, entropy)
        ctx.args = (vocab_start, temperature, chunk_size, with_entropy, dtype)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, target, lse, entropy = ctx.saved_tensors
        vocab_start, temperature, chunk_size, with_entropy, dtype = ctx.args
        grad_logp = None if grad_logp is None else grad_logp.to(dtype)
        if grad_logp is None and (grad_entropy is None or not with_entropy):
            return (None,) * 7
        grad = torch.empty_like(logits)
        scratch = logits.new_empty(min(chunk_size, logits.shape[0]), logits.shape[1], dtype=dtype)
        for s in range(0, logits.shape[0], chunk_size):
            rows = slice(s, s + chunk_size)
            _backward_chunk(
                logits[rows], target[rows], vocab_start, temperature, lse[rows],
                entropy[rows] if with_entropy else None,
                None if grad_logp is None else grad_logp[rows],
                None if grad_entropy is None or not with_entropy else grad_entropy[rows].to(dtype),
                grad[rows], scratch,
            )
        return grad, None, None, None, None, None, None


def _tp_rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _te_target_logprobs(
    logits: Tensor, target: Tensor, temperature: float, group: dist.ProcessGroup | None
) -> Tensor | None:
    """Target log-probs from TE's fused kernel, or None when TE cannot be used."""
    global _te_disabled
    try:
        from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy
    except ImportError:
        return None
    try:
        # z/T in fp32, as the torch path and vLLM do (a bf16 division rounds z/T a second time:
        # up to ~0.05 nat at |z| ~ 20). Also a fresh buffer, which some TE versions overwrite with
        # the gradient: out of place, since .float() of fp32 logits is the logits themselves (a
        # leaf that requires grad in the tests, the caller's tensor otherwise).
        # One fp32 copy: bf16 logits are converted (a new tensor, divided in place); fp32 ones divided
        # into a new tensor.
        tempered = logits.float()
        tempered = tempered / temperature if tempered is logits else tempered.div_(temperature)
        nll = parallel_cross_entropy(tempered.unsqueeze(0), target.unsqueeze(0), 0.0, False, group)
    except (torch.OutOfMemoryError, dist.DistError):
        # Not deterministic across ranks: one TP rank falling back to the torch path's all-reduces
        # while its peers wait in TE's all-gather would hang or mix collectives. Fail loudly instead.
        raise
    except Exception as err:   # noqa: BLE001 - TE's shape asserts, a Triton compile error under a newer
        # torch's Triton, a missing kernel: deterministic, so raised alike on every rank and all fall back together
        _te_disabled = True
        warnings.warn(f"Transformer-Engine cross-entropy unusable here ({type(err).__name__}: {err}); using the "
                      "torch path", stacklevel=2)
        return None
    return -nll.reshape(-1).float()


def vocab_parallel_logprobs(
    logits: Tensor,
    target: Tensor,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    use_te: bool | None = None,
) -> LogProbOutput:
    """Log-prob of ``target`` and entropy under softmax(logits / temperature).

    ``logits``: ``[..., vocab/TP]`` shard of this rank (contiguous, so flattening the
    leading dims is a view); ``target``: ``[...]`` global token ids. ``vocab_start``
    is the first global id of the shard (default ``rank · vocab/TP``). ``use_te``:
    None = auto (TE importable and CUDA), False = never, True = whenever possible.
    ``chunk_size``: rows per chunk (None = fit ``DEFAULT_CHUNK_BYTES``).
    Returns tensors shaped like ``target``; ``entropy`` is None unless requested.
    """
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_BYTES // (logits.shape[-1] * 4))
    if temperature <= 0 or chunk_size < 1:
        raise ValueError("temperature must be > 0 and chunk_size >= 1")
    rank, world = _tp_rank_world(tp_group)
    local_vocab = logits.shape[-1]
    start = rank * local_vocab if vocab_start is None else vocab_start
    flat_logits = logits.reshape(-1, local_vocab)
    flat_target = target.reshape(-1)
    # With entropy the chunked pass computes the log-probs as well; TE would only add a second
    # pass and a [tokens, vocab/TP] buffer kept for its backward.
    if not with_entropy and _want_te(use_te, flat_logits, start, rank):
        te_logp = _te_target_logprobs(flat_logits, flat_target, float(temperature), tp_group)
        if te_logp is not None:
            return LogProbOutput(te_logp.reshape(target.shape), None)
    logp, entropy = _ChunkedLogProbs.apply(
        flat_logits, flat_target, start, float(temperature), tp_group, int(chunk_size), with_entropy
    )
    return LogProbOutput(logp.reshape(target.shape), entropy.reshape(target.shape) if with_entropy else None)


def _want_te(use_te: bool | None, logits: Tensor, vocab_start: int, rank: int) -> bool:
    # TE derives each rank's vocabulary offset as rank · shard width.
    possible = logits.is_cuda and vocab_start == rank * logits.shape[-1] and not _te_disabled
    return possible and use_te is not False
