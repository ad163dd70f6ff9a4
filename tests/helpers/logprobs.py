"""Shared test helpers."""

from __future__ import annotations

import torch
from torch import Tensor


def reference(logits: Tensor, target: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """log p(target) and entropy in float64, straight from log_softmax."""
    log_probs = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return logp, entropy


def objective_grads(logits: Tensor, logp: Tensor, entropy: Tensor | None, w1: Tensor, w2: Tensor) -> Tensor:
    loss = (logp.double() * w1).sum() + (0 if entropy is None else (entropy.double() * w2).sum())
    (g,) = torch.autograd.grad(loss, logits)
    return g


def make(n: int, v: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, v, generator=gen, dtype=torch.float64)).to(dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    w1 = torch.randn(n, generator=gen, dtype=torch.float64)
    w2 = torch.randn(n, generator=gen, dtype=torch.float64)
    return logits, target, w1, w2


def make_head(n: int, hidden: int, v: int, dtype: torch.dtype,
              seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Hidden states [n, hidden] and an output weight [v, hidden] whose logits have std ~3, targets,
    and the two per-token loss weights."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=torch.float64)
    w = 3 * torch.randn(v, hidden, generator=gen, dtype=torch.float64) / hidden ** 0.5
    target = torch.randint(0, v, (n,), generator=gen)
    w1 = torch.randn(n, generator=gen, dtype=torch.float64)
    w2 = torch.randn(n, generator=gen, dtype=torch.float64)
    return h.to(dtype), w.to(dtype), target, w1, w2
