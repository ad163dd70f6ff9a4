"""Pieces of one training step that the loop calls: minibatches, CHORD's SFT rows, the probe
batch for sync verification, the step's timings and its metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from ..types import TrainBatch
from .batch import ScoredRollout


def minibatches(batch: TrainBatch, count: int) -> Iterator[TrainBatch]:
    """`steps_per_generation` consecutive slices of the rollout batch, one per optimizer step."""
    size = batch.num_rows // count
    for i in range(count):
        yield batch.rows(i * size, (i + 1) * size)


def _pack(sequences: list[list[int]], prompt_lengths: list[int], seq_len: int,
          pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((len(sequences), seq_len), pad, dtype=torch.long)
    mask = torch.zeros(len(sequences), seq_len - 1)
    for i, (seq, plen) in enumerate(zip(sequences, prompt_lengths)):
        seq = seq[:seq_len]
        tokens[i, :len(seq)] = torch.tensor(seq)
        mask[i, plen - 1:len(seq) - 1] = 1.0
    return tokens, mask


def sft_batch(session: Any, seq_len: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The next `chord.sft_batch_size` expert sequences (prompt masked out of the NLL)."""
    idx = session.sft_order.next_indices(session.cfg.algorithm.chord.sft_batch_size)
    rows = [session.sft[i] for i in idx]
    return _pack([r[1:] for r in rows], [r[0] for r in rows], seq_len, pad)


def probe_batch(session: Any, seq_len: int, pad: int, response: str, count: int = 4) -> TrainBatch:
    """A fixed batch for sync verification: the first prompts, each followed by `response`."""
    tok = session.tokenizer
    answer = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prompts = session.prompts.token_ids[:count]
    tokens, mask = _pack([p + answer for p in prompts], [len(p) for p in prompts], seq_len, pad)
    return TrainBatch(tokens=tokens, mask=mask, advantages=torch.zeros(len(prompts)))


def _masked_mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).sum() / mask.sum().clamp(min=1))


def step_metrics(scored: ScoredRollout, batch: TrainBatch, zero_variance_frac: float,
                 updates: list[dict[str, float]], timings: dict[str, float], extra: dict[str, float],
                 version: int) -> dict[str, float]:
    """`batch` is the trained one: policy log-probs, advantages, the mask after flat groups."""
    m: dict[str, float] = {"reward/mean": float(scored.rewards.mean()), "reward/std": float(scored.rewards.std()),
                           "response_length/mean": float(scored.response_lengths.mean()),
                           "zero_variance_group_frac": zero_variance_frac, "weight_version": version}
    for name, values in scored.reward_parts.items():
        m[f"reward/{name}/mean"] = float(values.mean())
        m[f"reward/{name}/std"] = float(values.std())
    assert batch.old_logprobs is not None and batch.rollout_logprobs is not None, \
        "a trained batch carries the old and the rollout log-probs"
    m["mismatch/abs_mean"] = _masked_mean_abs(batch.old_logprobs, batch.rollout_logprobs, batch.mask)
    last = updates[-1]
    for key, value in last.items():
        m[key if key in ("grad_norm", "lr", "update_skipped") else f"train/{key}"] = value
    m["update_skipped_count"] = float(sum(u["update_skipped"] for u in updates))
    m["kl"] = last.get("token/kl_mean", float("nan"))
    m["clip_frac"] = last.get("token/clip_low_frac", 0.0) + last.get("token/clip_high_frac", 0.0) \
        if "token/clip_low_frac" in last else last.get("seq/clip_low_frac", 0.0) + last.get("seq/clip_high_frac", 0.0)
    m["entropy"] = last.get("token/entropy_mean", float("nan"))
    m.update(timings)
    m.update(extra)
    m["time/step"] = sum(v for k, v in timings.items() if k.startswith("time/"))
    tokens = float(batch.mask.sum())
    m["tokens_per_s"] = tokens / max(m["time/step"], 1e-9)
    return m


def timed(timings: dict[str, float], name: str) -> Any:
    """A context that records its wall time as `timings["time/<name>"]`."""
    class _Timer:
        def __enter__(self) -> None:
            self.t = time.perf_counter()

        def __exit__(self, *exc: Any) -> None:
            timings[f"time/{name}"] = time.perf_counter() - self.t

    return _Timer()
