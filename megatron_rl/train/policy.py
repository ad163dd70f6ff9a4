"""The trainer's side of one step: the policy (the actor) and its reference. Their log-probs of the
rollout batch (π_old, π_ref) with the routing metrics of R3, then `steps_per_generation` optimizer
updates on consecutive minibatches (CHORD adds the next expert rows to each)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

import torch

from ..config.schema import RecipeConfig
from ..megatron.actor import Actor, Training, init_parallel
from ..megatron.checkpoint import load_weights
from ..megatron.lora import adapters_disabled
from ..model_config import InitCheckpoint, init_checkpoint, is_megatron_checkpoint, read_hf_config
from ..models import build_model, weight_map
from ..objectives.chord import optimizer_step
from ..types import TrainBatch
from ..weights.loading import load_hf_into_model
from ..weights.map import WeightAdapter
from .batch import pack
from .data import SftRows
from .run import require


class Reference(Protocol):
    def compute_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor: ...


class BaseReference:
    """The reference policy of `model.reference: init` under LoRA: the actor with its adapters
    switched off (the frozen base is the initial model), no second copy of the weights."""

    def __init__(self, actor: Actor) -> None:
        self.actor = actor

    def compute_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        # The reference routes by itself, as a separate reference actor does (`routing_replay_default`).
        with adapters_disabled(self.actor.model):
            return self.actor.compute_logprobs(batch, temperature, replay=False)


def uses_base_reference(cfg: RecipeConfig) -> bool:
    return cfg.lora.rank > 0 and cfg.model.reference == "init"


def old_from_update(cfg: RecipeConfig) -> bool:
    """Whether π_old's log-probs are the update's own forward, detached, with no forward of their
    own (as TRL and ms-swift do): with one update per rollout the actor's ratio is 1 by
    construction (`Actor.train_step`), so only metrics read them. Not when the reward's KL penalty
    needs them before the update, nor under LoRA dropout (the training forward's noise would enter
    `mismatch/abs_mean`); a batch with MoE routes keeps its forward for the routing metrics."""
    a = cfg.algorithm
    return a.steps_per_generation == 1 and not a.kl_in_reward and cfg.lora.dropout == 0.0


def starting_checkpoint(cfg: RecipeConfig) -> InitCheckpoint:
    """Where the policy starts: an HF directory or a Megatron dist-checkpoint."""
    require(cfg.model.init_checkpoint, "model.init_checkpoint (an HF directory or a Megatron dist-checkpoint)")
    return init_checkpoint(cfg.model)


class Policy:
    """The actor being trained and the reference its KL term is measured against (none without
    one; with LoRA and `model.reference: init`, the actor's own base). Every method is collective."""

    def __init__(self, cfg: RecipeConfig, init: InitCheckpoint, updates: int) -> None:
        """`updates`: the run's optimizer steps (the LR schedule's length)."""
        self.cfg, self.init = cfg, init
        self.hf = read_hf_config(init.hf_dir)
        self.adapter = weight_map(self.hf)
        self.dtype = torch.bfloat16 if (cfg.model.params_dtype == "bf16" or
                                        (cfg.model.params_dtype == "auto" and torch.cuda.is_available())) \
            else torch.float32
        t = cfg.trainer
        init_parallel(cfg.parallelism, t.seed, t.collective_timeout_min)
        recipe = build_model(self.hf, cfg.parallelism, self.dtype)
        self.actor = Actor(recipe, t.micro_batch_size, Training(t, cfg.parallelism, updates),
                           t.max_tokens_per_microbatch, lora=cfg.lora, fused_lm_head=t.fused_lm_head)
        load_init(self.actor, init.path, self.adapter)
        self.reference: Reference | None = None if not cfg.algorithm.uses_reference else \
            BaseReference(self.actor) if uses_base_reference(cfg) else self._reference(recipe)

    def _reference(self, recipe: Any) -> Actor:
        t, m = self.cfg.trainer, self.cfg.model
        ref = Actor(recipe, t.micro_batch_size, None, t.max_tokens_per_microbatch, fused_lm_head=t.fused_lm_head)
        load_init(ref, require(m.reference_path, "model.reference_path") if m.reference == "path" else self.init.path,
                  self.adapter)
        return ref

    @property
    def temperature(self) -> float:
        """The temperature of the rollout's log-probs, at which the trainer computes its own."""
        return self.cfg.rollout.logprobs_temperature

    @property
    def hf_dir(self) -> str:
        """The HF config and tokenizer files of the starting checkpoint."""
        return self.init.hf_dir

    def logprobs(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """`batch` with the actor's log-probs before any update (π_old) and, when the run has a
        reference model, the reference's; and the routing metrics of the π_old forward when the batch
        carries the rollout's MoE routes. With `old_from_update(cfg)` (and no routes) π_old is left
        None: `with_old_from_update` fills it after the update."""
        t = self.temperature
        if old_from_update(self.cfg) and batch.routes is None:
            ref = self.reference.compute_logprobs(batch, t) if self.reference is not None else None
            return replace(batch, old_logprobs=None, ref_logprobs=ref), {}
        old = self.actor.compute_logprobs(batch, t)
        routing = self._routing_metrics(batch, self.cfg.rollout.routing_replay_diagnostics)
        ref = self.reference.compute_logprobs(batch, t) if self.reference is not None else None
        return replace(batch, old_logprobs=old, ref_logprobs=ref), routing

    def _routing_metrics(self, batch: TrainBatch, diagnostics: bool) -> dict[str, float]:
        """`routing/mismatch_frac` of the old-log-prob forward (the share of recorded (token, layer)
        rows whose trainer top-k differs from the rollout's: what replay overrides). With
        `diagnostics`: per layer, and the log-prob gap to the rollout without replay (one more
        forward; `mismatch/abs_mean` is the gap with replay)."""
        if batch.routes is None:
            return {}
        out = {k: v for k, v in self.actor.routing_metrics.items() if diagnostics or "/layer_" not in k}
        if diagnostics and batch.rollout_logprobs is not None:
            plain = self.actor.compute_logprobs(batch, self.temperature, replay=False)
            gap = ((plain - batch.rollout_logprobs).abs() * batch.mask).sum() / batch.mask.sum().clamp(min=1)
            out["mismatch/abs_mean_no_replay"] = float(gap)
        return out

    def update(self, batch: TrainBatch, step: int, sft: SftRows | None) -> list[dict[str, float]]:
        """One optimizer step per minibatch (with `sft`, CHORD's next expert rows added to each);
        returns each step's metrics."""
        a, r = self.cfg.algorithm_in_force, self.cfg.rollout
        seq_len = r.max_prompt_length + r.max_response_length
        updates = []
        for i, mb in enumerate(minibatches(batch, a.steps_per_generation)):
            if sft is not None:
                rows = sft.next(a.chord.sft_batch_size)
                sft_tokens, sft_mask = pack([r[1:] for r in rows], [r[0] for r in rows], seq_len, sft.pad_id)
                mb = replace(mb, sft_tokens=sft_tokens, sft_mask=sft_mask)
            # CHORD's μ counts optimizer steps (as ms-swift does), not rollout steps.
            updates.append(self.actor.train_step(mb, a, temperature=self.temperature,
                                                 rl_step=optimizer_step(step, a.steps_per_generation, i)))
        return updates

    def with_old_from_update(self, batch: TrainBatch) -> TrainBatch:
        """`batch` (the updated one) with π_old's log-probs from the update's forward when
        `logprobs` left them out; else `batch` itself."""
        if batch.old_logprobs is not None:
            return batch
        assert self.actor.trained_logprobs is not None, "the update kept its log-probs (old_logprobs was None)"
        return replace(batch, old_logprobs=self.actor.trained_logprobs)

    def matches_server_load(self, resumed: bool) -> bool:
        """Whether the servers' own load of the starting checkpoint equals the trainer's weights (so
        that the verification noise floor can be measured before any sync): a fresh run from an HF
        directory with an unquantized base."""
        return not resumed and not self.init.megatron and self.actor.quantization is None


def minibatches(batch: TrainBatch, count: int) -> Iterator[TrainBatch]:
    """`steps_per_generation` consecutive slices of the rollout batch, one per optimizer step."""
    size = batch.num_rows // count
    for i in range(count):
        yield batch.rows(i * size, (i + 1) * size)


def load_init(actor: Actor, path: str, adapter: WeightAdapter) -> None:
    """Starting weights from an HF directory or a Megatron dist-checkpoint (any layout)."""
    if is_megatron_checkpoint(path):
        load_weights(actor, path)
        return
    load_hf_into_model(actor.model, path, adapter)
    if actor.trainable:
        actor.optimizer.reload_model_params()   # fp32 master weights follow the loaded weights

