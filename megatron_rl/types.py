"""Small typed records that cross module boundaries (rollout → rewards → trainer → actor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import numpy as np

    from .route_rows import HeldRoutes, RouteRows


@dataclass
class Sample:
    """One generated completion of one prompt."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    """Per-token log-probs reported by the rollout engine (see `logprobs_mode`)."""
    text: str = ""
    finish_reason: str = ""
    weight_version: int = 0
    """Version of the policy weights the server generated with."""
    routed_experts: np.ndarray | HeldRoutes | None = None
    """[prompt_len + gen_len − 1, num_hidden_layers, topk] expert ids when routes are recorded
    (`rollout.routing_replay`; `rollout/routes.py`); in the trainer's groups their `HeldRoutes`
    (the array stays on rank 0: `route_rows.py`)."""


@dataclass
class RolloutGroup:
    """The n samples of one prompt, with the prompt's record (gold answers, metadata)."""

    prompt_index: int
    record: dict[str, Any]
    samples: list[Sample]


@dataclass
class TrainBatch:
    """Rows of token sequences aligned to *target* positions (length L − 1 for tokens of length L).

    Position t of every [N, L−1] tensor refers to predicting `tokens[:, t + 1]`. `mask` marks the
    response tokens that the loss sees. `sft_*` rows (CHORD's expert stream) are separate
    sequences that ride in the same micro-batches.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    sft_tokens: torch.Tensor | None = None
    sft_mask: torch.Tensor | None = None
    routes: RouteRows | None = None
    """MoE routing of the rollout, aligned to `tokens`: per row its sample's compact expert ids,
    expanded to [rows, L, num_hidden_layers, topk] one micro-batch at a time (`route_rows.py`,
    `megatron/routing_replay.py`)."""

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device) -> TrainBatch:
        """The same rows with every tensor on `device` (no copy for tensors already there)."""
        fields: dict[str, Any] = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                                  for k, v in self.__dict__.items()}
        return TrainBatch(**fields)     # routes stay on the host until their micro-batch is fed

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop) of the RL part; the SFT part is split proportionally by the caller."""
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop]
        routes = None if self.routes is None else self.routes.select(range(len(self.routes))[start:stop])
        return TrainBatch(self.tokens[start:stop], self.mask[start:stop], self.advantages[start:stop],
                          cut(self.old_logprobs), cut(self.ref_logprobs), cut(self.rollout_logprobs),
                          self.sft_tokens, self.sft_mask, routes)
