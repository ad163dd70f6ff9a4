"""The Megatron-core actor: model chunks + DDP + DistributedOptimizer + LR schedule, driven through
`get_forward_backward_func` with the RL objective as the loss.

Loss contract: each micro-batch's loss is its *sum* divided by the global denominators of the whole
optimizer step (all micro-batches, all DP ranks), so Megatron must neither average over
micro-batches nor over DP: `calculate_per_token_loss=True` turns the schedule's division off and
makes DDP sum gradients, and `finalize_model_grads` is called without a token count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..config.schema import AlgorithmConfig, LoraConfig, ParallelismConfig, TrainerConfig
from ..logprobs import LogProbOutput, vocab_parallel_logprobs
from ..objectives import (
    LossInputs,
    all_reduce_metrics,
    combine_metrics,
    denominators_from_masks,
    finalize_metrics,
    get_objective,
)
from ..schedule import warmup_updates
from ..types import TrainBatch
from . import cpu_compat
from .devices import DEFAULT_COLLECTIVE_TIMEOUT_MIN, compute_device, init_distributed
from .gpt import ModelRecipe, build_gpt_model
from .head import HeadRequest, fused_output
from .microbatch import MicroBatchPlan, needed_lengths, plan_microbatches, take
from .route_delivery import deliver
from .routing_replay import RoutingReplay

cpu_compat.require_applied()   # megatron-core below needs the CPU patches on a machine without CUDA

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402


def init_parallel(layout: ParallelismConfig, seed: int,
                  timeout_min: float = DEFAULT_COLLECTIVE_TIMEOUT_MIN) -> None:
    """torch.distributed (see `devices.init_distributed`) + Megatron's parallel groups, re-entrant.
    The groups wait as long as the world group (trainer.collective_timeout_min), not megatron's 30
    minutes: a TP/DP/EP collective can wait out a rollout just like the world's."""
    init_distributed(timeout_min)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
        distributed_timeout_minutes=math.ceil(timeout_min),
    )
    model_parallel_cuda_manual_seed(seed)


class Training(NamedTuple):
    """What a trainable actor is built from: the recipe's own sections, no copies."""

    trainer: TrainerConfig
    parallelism: ParallelismConfig
    total_updates: int
    """Optimizer steps of the whole run (the LR schedule's length)."""


def ddp_config(p: ParallelismConfig) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=p.use_distributed_optimizer,
        overlap_grad_reduce=p.overlap_grad_reduce, overlap_param_gather=p.overlap_param_gather,
    )


def optimizer_config(t: TrainerConfig, p: ParallelismConfig, model: Any) -> OptimizerConfig:
    """AdamW from the recipe's trainer section; placement (sharding, host offload) from its
    parallelism section. `model` is the TransformerConfig (dtype)."""
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=p.optimizer_offload_fraction,
                   # megatron-core's offload recipe: the host Adam keeps the fp32 masters itself.
                   use_precision_aware_optimizer=True) if p.optimizer_cpu_offload else {}
    return OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        clip_grad=t.clip_grad, bf16=model.bf16, params_dtype=model.params_dtype,
        use_distributed_optimizer=p.use_distributed_optimizer, **offload,
    )


def unwrap(model: torch.nn.Module) -> Any:
    """The GPTModel inside DDP (and any other `.module` wrappers). Typed `Any`: callers read
    megatron's dynamic attributes (`decoder`, `config`, `output_layer`, ...)."""
    inner: Any = model
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def _finalize_without_token_scaling(model: list[torch.nn.Module], num_tokens: Any = None, **kwargs: Any) -> None:
    finalize_model_grads(model, None, **kwargs)


class Actor:
    """One rank's share of the policy (or, without `training`, of a frozen reference)."""

    def __init__(self, recipe: ModelRecipe, micro_batch_size: int, training: Training | None,
                 max_tokens_per_microbatch: int | None = None, replay_routes: bool | None = None,
                 lora: LoraConfig | None = None, fused_lm_head: bool = True) -> None:
        """`training` None builds a frozen reference (no DDP, no optimizer). With `lora` (rank > 0)
        the base is frozen and only adapters train (`lora.py`). `fused_lm_head`: log-probs from the
        last hidden states (`head.py`), not from the output layer's logits (`trainer.fused_lm_head`).

        `replay_routes`: a MoE model's routers use the rollout's experts for batches that carry
        `routes` (None: the policy does, a reference does not — see `routing_replay_default`)."""
        if lora is not None and lora.rank > 0 and lora.base_quantization != "none":
            from .qlora_spec import for_quantized_base

            recipe = for_quantized_base(recipe)   # QLoRA: local linears that can hold the NF4 base
        self.recipe = recipe
        self.config = recipe.config
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        """Token budget of a micro-batch (see `microbatch.py`); None = `micro_batch_size` padded rows."""
        self.training = training
        # MuP scales the logits after the output layer and MTP adds its own heads: not what the
        # fused head computes, so those models keep the logits.
        self.fused_lm_head = fused_lm_head and not self.config.use_mup and not self.config.mtp_num_layers
        self.device = compute_device()
        # Every parameter on the device, also those megatron builds without one (the shared-expert
        # gate, the GDN output norm): the frozen reference gets no DDP to move them.
        model = build_gpt_model(recipe).to(self.device)
        self.trainable = training is not None
        self.routing = RoutingReplay(model, self.config) if self.config.num_moe_experts else None
        self.replay_routes = routing_replay_default(self.trainable) if replay_routes is None else replay_routes
        self.routing_metrics: dict[str, float] = {}
        """Routing counts of the last `compute_logprobs` that had routes (`routing/...`, per layer too)."""
        self.trained_logprobs: torch.Tensor | None = None
        """The last `train_step`'s own log-probs [N, L−1] (as `compute_logprobs` gives them) when
        its batch came without old log-probs (π_old is that forward: `steps_per_generation` 1)."""
        self.lora = None
        self.quantization: Any = None
        """QLoRA: what `quantize.quantize_frozen_base` did (None: the base is in the training dtype)."""
        if lora is not None and lora.rank > 0:
            from .lora import apply_lora

            self.lora = apply_lora(model, lora, seed=training.trainer.seed if training is not None else 0)
            if lora.base_quantization != "none":    # QLoRA: the now frozen base in 4 bits
                from .quantize import quantize_frozen_base

                self.quantization = quantize_frozen_base(model, lora.base_quantization)
        if training is not None:
            p = training.parallelism
            model = DistributedDataParallel(config=self.config, ddp_config=ddp_config(p), module=model)
            self.config.finalize_model_grads_func = _finalize_without_token_scaling
            if p.overlap_grad_reduce:
                # Reduce only after the last micro-batch's backward (Megatron-LM's wiring).
                self.config.no_sync_func = model.no_sync
            self.optimizer = get_megatron_optimizer(optimizer_config(training.trainer, p, self.config), [model])
            self.scheduler = self._scheduler(training.trainer, training.total_updates)
        else:
            for p in model.parameters():
                p.requires_grad_(False)
        self.model = model
        self.step = 0

    def _scheduler(self, t: TrainerConfig, total_updates: int) -> OptimizerParamScheduler:
        warmup = warmup_updates(t.lr_warmup_ratio, total_updates)     # transformers' ⌈ratio × steps⌉
        total = max(total_updates, warmup + 1)
        return OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else t.lr, max_lr=t.lr, min_lr=t.min_lr,
            lr_warmup_steps=warmup, lr_decay_steps=total, lr_decay_style=t.lr_decay_style,
            start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=total, wd_incr_style="constant",
        )

    def _finish_param_gather(self) -> None:
        """With `overlap_param_gather` the optimizer step leaves the updated shards un-gathered
        until the next forward; weight sync and checkpoints read the parameters directly, so
        gather them now (what Megatron-LM does before saving)."""
        if self.training is not None and self.training.parallelism.overlap_param_gather:
            self.model.start_param_sync(force_sync=True)

    # ------------------------------------------------------------------ data split
    def _local_microbatches(self, batch: TrainBatch) -> list[TrainBatch]:
        """This DP rank's rows, cut into micro-batches of `micro_batch_size` rows (or, with a token
        budget, into length-grouped micro-batches cut to their longest row). Collective when the
        batch carries routes (`_deliver_routes`)."""
        return self._split(batch)[0]

    def _split(self, batch: TrainBatch) -> tuple[list[TrainBatch], list[MicroBatchPlan] | None]:
        """`_local_microbatches`, with this rank's budget plans (None: the padded split). Every
        replica first receives the routes of the rows it computes here."""
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if self.max_tokens_per_microbatch is not None:
            plans = self._budget_plans(batch)
            self._deliver_routes(batch, [[i for plan in mine for i in plan.rows] for mine in plans])
            return [take(batch, plan) for plan in plans[rank]], plans[rank]
        n = batch.num_rows
        if n % (dp * self.micro_batch_size):
            raise ValueError(f"{n} rows do not split into DP {dp} × micro-batches of {self.micro_batch_size}")
        per_rank = n // dp
        self._deliver_routes(batch, [range(d * per_rank, (d + 1) * per_rank) for d in range(dp)])
        local = batch.rows(rank * per_rank, (rank + 1) * per_rank)
        mbs = [local.rows(i, i + self.micro_batch_size) for i in range(0, per_rank, self.micro_batch_size)]
        if batch.sft_tokens is not None:
            self._attach_sft(batch, mbs, rank, dp)
        return mbs, None

    def _deliver_routes(self, batch: TrainBatch, rows_per_dp: Sequence[Sequence[int]]) -> None:
        """The routes of the rows each DP replica computes in this forward, to that replica's ranks
        (`route_delivery.py`); a dense model's batches carry none (the same on every rank)."""
        if self.routing is not None and batch.routes is not None:
            deliver(batch.routes, rows_per_dp)

    def _budget_plans(self, batch: TrainBatch) -> list[list[MicroBatchPlan]]:
        """Every DP rank's share of the step's budget micro-batches (the same plan on every rank)."""
        if self.config.moe_token_dispatcher_type == "allgather" and ps.get_expert_model_parallel_world_size() > 1:
            raise ValueError("token-budget micro-batches give expert-parallel ranks different token counts, "
                             "which the 'allgather' MoE dispatcher cannot exchange; use 'alltoall'")
        cp = ps.get_context_parallel_world_size()
        # Sequence parallelism splits the sequence over TP ranks, context parallelism in 2·CP chunks.
        multiple = (ps.get_tensor_model_parallel_world_size() if self.config.sequence_parallel else 1) * \
            (2 * cp if cp > 1 else 1)
        sft = None if batch.sft_mask is None else needed_lengths(batch.sft_mask)
        assert self.max_tokens_per_microbatch is not None, "budget plans need trainer.max_tokens_per_microbatch"
        return plan_microbatches(needed_lengths(batch.mask), ps.get_data_parallel_world_size(),
                                 self.max_tokens_per_microbatch, multiple, sft)

    @staticmethod
    def _attach_sft(batch: TrainBatch, mbs: list[TrainBatch], rank: int, dp: int) -> None:
        """This DP rank's expert rows, spread over its micro-batches as evenly as they go (some may
        carry none): the SFT term's denominators are global, so where a row is computed does not
        change the loss. Pipelines exchange shapes per micro-batch (`variable_seq_lengths`)."""
        assert batch.sft_tokens is not None and batch.sft_mask is not None, "called for batches with SFT rows"
        sft_rows = batch.sft_tokens.shape[0]
        if sft_rows % dp:
            raise ValueError(f"{sft_rows} SFT rows do not split over DP {dp} (algorithm.chord.sft_batch_size "
                             "must be a multiple of the data-parallel size)")
        per_rank = sft_rows // dp
        bounds = [rank * per_rank + per_rank * i // len(mbs) for i in range(len(mbs) + 1)]
        for mb, start, end in zip(mbs, bounds, bounds[1:]):
            mb.sft_tokens = batch.sft_tokens[start:end]
            mb.sft_mask = batch.sft_mask[start:end]

    # ------------------------------------------------------------------ forward
    def _logits(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        return model(tokens, positions, None)

    def _head(self, model: torch.nn.Module, tokens: torch.Tensor, temperature: float,
              with_entropy: bool) -> torch.Tensor | LogProbOutput:
        """The last stage's output for `_logprobs`: the logits, or with the fused head the scored
        targets themselves (earlier stages return their hidden states either way)."""
        if not self.fused_lm_head:
            return self._logits(model, tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        request = HeadRequest(_targets(tokens), temperature, with_entropy)
        return model(tokens, positions, None, output_processor=fused_output, output_processor_context=request)

    def _tokens_of(self, mb: TrainBatch) -> torch.Tensor:
        if mb.sft_tokens is None:
            return mb.tokens
        width = max(mb.tokens.shape[1], mb.sft_tokens.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
        return torch.cat([pad(mb.tokens), pad(mb.sft_tokens)], dim=0)

    def _logprobs(self, logits: torch.Tensor | LogProbOutput, tokens: torch.Tensor, temperature: float,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[rows, L−1] log-probs of tokens[:, 1:]. All L positions are scored against the targets
        shifted left (the last one is a dummy) and the last column dropped: `logits[:, :-1]` is not
        contiguous for more than one row, and flattening it would copy all the logits. `logits` may
        be the fused head's output already (`_head`), scored the same way."""
        out = logits if isinstance(logits, LogProbOutput) else vocab_parallel_logprobs(
            logits, _targets(tokens), ps.get_tensor_model_parallel_group(), temperature=temperature,
            with_entropy=with_entropy)
        return out.logprobs[:, :-1], None if out.entropy is None else out.entropy[:, :-1]

    def _feed_routes(self, mb: TrainBatch, tokens: torch.Tensor, replay: bool, recompute: bool) -> None:
        """This micro-batch's routes to the routers, expanded here from the compact per-sample form
        to the shape of `tokens` (CHORD's expert rows and pad columns have none: the trainer routes
        them itself). Every PP stage feeds its own layers."""
        if self.routing is None:
            return
        if mb.routes is None:
            self.routing.feed(None, None, False)
            return
        routes, valid = mb.routes.dense(tokens.shape[0], tokens.shape[1])
        self.routing.feed(routes, valid, replay, recompute)

    def _run(self, mbs: list[TrainBatch], loss_for: Any, forward_only: bool, replay: bool = False, *,
             temperature: float, with_entropy: bool) -> list[Any]:
        seq_len = max(self._tokens_of(mb).shape[1] for mb in mbs)
        budget = self.max_tokens_per_microbatch is not None
        # Budget micro-batches differ in rows and width. Under PP, megatron-core sends each
        # activation's shape ahead of it (`variable_seq_lengths`, set by the provider for PP > 1),
        # so every micro-batch is computed exactly as on its own; padding them to one shape would
        # spend the savings.

        def forward_step(data_iterator: Iterator[TrainBatch], model: torch.nn.Module) -> tuple[Any, Any]:
            mb = next(data_iterator).to(self.device)
            tokens = self._tokens_of(mb)
            if not budget:
                tokens = torch.nn.functional.pad(tokens, (0, seq_len - tokens.shape[1]))
            self._feed_routes(mb, tokens, replay, recompute)
            return self._head(model, tokens, temperature, with_entropy), partial(loss_for, mb, tokens)

        # Activation recompute (full, or a selective module list with the MoE layer) re-runs the
        # routers in backward, after later micro-batches were fed: keep each forward's routes.
        recompute = not forward_only
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.model],
                num_microbatches=len(mbs), seq_length=seq_len, micro_batch_size=self._tokens_of(mbs[0]).shape[0],
                forward_only=forward_only,
            )
        finally:
            if self.routing is not None:
                self.routing.clear()

    def compute_logprobs(self, batch: TrainBatch, temperature: float, replay: bool | None = None) -> torch.Tensor:
        """Per-target-position log-probs of `batch.tokens` [N, L−1], on every rank, on the CPU
        (everything above the actor stays on the CPU; micro-batches move to the device here).

        With a token budget a row is computed only through its last masked target (`batch.mask`);
        the positions after it hold 0 or a pad's log-prob, as the padded path's pads do.

        A batch with `routes` is scored with them replayed (`replay`, default the actor's
        `replay_routes`) and the routing counts land in `self.routing_metrics`."""
        self.model.eval()
        # Any number of rows: pad with copies of row 0 up to a multiple of DP × micro-batch.
        n = batch.num_rows
        budget = self.max_tokens_per_microbatch is not None
        unit = ps.get_data_parallel_world_size() * (1 if budget else self.micro_batch_size)
        extra = (-n) % unit
        tokens = torch.cat([batch.tokens, batch.tokens[:1].expand(extra, -1)]) if extra else batch.tokens
        # The mask tells the budget path how far each row must be computed (filler rows: 2 tokens).
        mask = torch.cat([batch.mask, batch.mask.new_zeros(extra, batch.mask.shape[1])]) if extra else batch.mask
        rows = TrainBatch(tokens, mask, torch.zeros(n + extra),
                          routes=None if batch.routes is None else batch.routes.padded(n + extra))
        mbs, plans = self._split(rows)

        def loss_for(mb: TrainBatch, tokens: torch.Tensor, logits: torch.Tensor | LogProbOutput) -> tuple[Any, ...]:
            logp, _ = self._logprobs(logits, tokens, temperature, with_entropy=False)
            return logp.sum() * 0.0, torch.tensor(1), {"logprobs": logp.detach()[:, : mb.tokens.shape[1] - 1]}

        with torch.no_grad():
            reports = self._run(mbs, loss_for, forward_only=True,
                                replay=self.replay_routes if replay is None else replay,
                                temperature=temperature, with_entropy=False)
        if self.routing is not None and batch.routes is not None:
            self.routing_metrics = self.routing.take_metrics(self.config.num_layers, per_layer=True)
        return self._collect([r["logprobs"] for r in reports], plans, rows.mask, n)

    def _collect(self, parts: list[torch.Tensor], plans: list[MicroBatchPlan] | None, mask: torch.Tensor,
                 n: int) -> torch.Tensor:
        """This rank's micro-batch log-probs → the batch's first `n` rows [n, L−1] in batch order,
        on the CPU of every rank (collective over DP, then from the last pipeline stage)."""
        full = None
        if ps.is_pipeline_last_stage():
            full = self._gather_dp(torch.cat(parts, dim=0)) if plans is None else \
                self._scatter_dp(plans, parts, mask.shape[0], mask.shape[1], max(needed_lengths(mask)) - 1)
            full = full[:n].cpu()
        return _broadcast_from_last_stage(full)

    @staticmethod
    def _scatter_dp(plans: list[MicroBatchPlan], parts: list[torch.Tensor], num_rows: int,
                    width: int, used: int) -> torch.Tensor:
        """Every rank's micro-batch log-probs in batch order, [num_rows, width], zero after each
        row's cut; only the first `used` columns (the batch's longest need) travel.

        Each row lives on exactly one DP rank, so a sum over ranks of zero-filled buffers is
        exact; NCCL needs the buffer on the GPU, gloo takes it where it is."""
        group = ps.get_data_parallel_group()
        device = parts[0].device        # CPU under gloo, the rank's GPU under NCCL (or cpu:gloo,cuda:nccl)
        used = min(used, width)
        full = torch.zeros(num_rows, used, dtype=parts[0].dtype, device=device)
        for plan, logp in zip(plans, parts):
            w = min(used, logp.shape[1])
            full[torch.tensor(plan.rows, device=device), :w] = logp[:, :w].to(device)
        dist.all_reduce(full, group=group)
        return torch.nn.functional.pad(full, (0, width - used))

    @staticmethod
    def _gather_dp(local: torch.Tensor) -> torch.Tensor:
        group = ps.get_data_parallel_group()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    # ------------------------------------------------------------------ train
    def train_step(self, batch: TrainBatch, algorithm: AlgorithmConfig, *, temperature: float,
                   rl_step: int) -> dict[str, float]:
        """One optimizer step on `batch` (all rows of this step, identical on every rank) with the
        objective `algorithm.name`."""
        self.model.train()
        denoms = denominators_from_masks([batch.mask], batch.mask.shape[1])
        sft_denoms = None if batch.sft_mask is None else \
            denominators_from_masks([batch.sft_mask], batch.sft_mask.shape[1])
        mbs, plans = self._split(batch)
        loss_fn = get_objective(algorithm.name)
        # One update per rollout: the weights that sampled are the weights being trained, so π_old
        # is this forward itself, detached (ratio exactly 1, as ms-swift's and verl's on-policy
        # paths). A second forward would differ from it by bf16 rounding of other micro-batch
        # shapes and by LoRA dropout, noise that a sequence-level clip of 3e-4 would act on.
        on_policy = algorithm.steps_per_generation == 1
        # Without old log-probs the caller skipped the π_old forward: this forward's are kept for it.
        if batch.old_logprobs is None and not on_policy:
            raise ValueError("train_step needs the batch's old log-probs unless steps_per_generation is 1")
        kept: list[torch.Tensor] | None = [] if batch.old_logprobs is None else None

        def loss_for(mb: TrainBatch, tokens: torch.Tensor, logits: torch.Tensor | LogProbOutput) -> tuple[Any, ...]:
            # Entropy comes from the same chunked pass as the log-probs (no extra pass; detached
            # unless the loss has an entropy term), and is logged either way.
            logp, entropy = self._logprobs(logits, tokens, temperature, with_entropy=True)
            rows, width = mb.tokens.shape[0], mb.tokens.shape[1] - 1
            own = logp[:rows, :width]
            if kept is not None:
                kept.append(own.detach())
            old = own.detach() if on_policy else mb.old_logprobs
            assert old is not None, "checked above"
            inputs = LossInputs(
                logprobs=own, old_logprobs=old,
                advantages=mb.advantages,
                mask=mb.mask, ref_logprobs=mb.ref_logprobs, rollout_logprobs=mb.rollout_logprobs,
                entropy=None if entropy is None else entropy[:rows, :width],
            )
            if mb.sft_tokens is not None:
                inputs.sft_logprobs = logp[rows:, : mb.sft_tokens.shape[1] - 1]
                inputs.sft_mask = mb.sft_mask
            out = loss_fn(inputs, algorithm, denoms, step=rl_step, sft_denoms=sft_denoms)
            return out.loss, torch.tensor(1), {k: v.detach() for k, v in out.metrics.items()}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._run(mbs, loss_for, forward_only=False, replay=self.replay_routes,
                            temperature=temperature, with_entropy=True)
        self.trained_logprobs = None if kept is None else self._collect(kept, plans, batch.mask, batch.num_rows)
        metrics = self._reduce_reports(reports)
        if self.routing is not None and batch.routes is not None:
            metrics.update(self.routing.take_metrics(self.config.num_layers, per_layer=False))
        loss_finite = all(math.isfinite(v) for k, v in metrics.items() if k.startswith("loss/"))
        # A non-finite loss or gradient would poison the weights and Adam's moments: skip the
        # update (the caller counts skipped steps and stops after several in a row).
        ok, grad_norm = self._guarded_step() if loss_finite else (False, math.nan)
        if ok:
            self.scheduler.step(increment=1)
        self._finish_param_gather()
        self.step += 1
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["update_skipped"] = float(not ok)
        return metrics

    def _guarded_step(self) -> tuple[bool, float]:
        """Megatron's optimizer step, split so that a non-finite gradient norm skips it.

        bf16 has no grad scaler, so `prepare_grads` finds no inf on its own, and the main grads
        exist only after it ran (before, the norm reads as 0). A NaN/Inf gradient under a finite
        loss would otherwise reach the weights and Adam's moments. Returns (stepped, norm)."""
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            return False, grad_norm
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
            if params and opt.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(params, opt.config.clip_grad, grad_norm,
                                             use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return bool(self.optimizer.step_with_ready_grads()), grad_norm

    def _reduce_reports(self, reports: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if ps.is_pipeline_last_stage():
            combined = all_reduce_metrics(combine_metrics(reports), ps.get_data_parallel_group())
            metrics = finalize_metrics(combined)
        return _broadcast_from_last_stage(metrics)


def _targets(tokens: torch.Tensor) -> torch.Tensor:
    """Each position's next token; the last position's target is a dummy 0 (dropped by `_logprobs`)."""
    return torch.nn.functional.pad(tokens[:, 1:], (0, 1))


def routing_replay_default(trainable: bool) -> bool:
    """Whether an actor replays the rollout's routes by default: the policy does, in both the
    old-log-prob and the training forward, so the ratio and the gradient are of the policy that
    sampled the tokens. A reference does not: it stands for the frozen initial policy, whose own
    routing of these tokens is deterministic and unaffected by the rollout engine; routes chosen by
    the current weights would make it a hybrid that is neither policy, and the KL term would then
    measure the distance to a moving target."""
    return trainable


def _broadcast_from_last_stage(value: Any) -> Any:
    """Every rank gets what the last pipeline stage computed (losses and log-probs live there)."""
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return value
    box = [value]
    src = dist.get_global_rank(ps.get_pipeline_model_parallel_group(), pp - 1)
    dist.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group())
    return box[0]
