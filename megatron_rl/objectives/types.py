"""Plain records shared by every objective: inputs, configuration and output.

The recipe configuration is mapped onto :class:`ObjectiveConfig` by the trainer;
field names are part of that contract, so rename them only together with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class LossInputs:
    """Per-micro-batch tensors for one loss evaluation (shapes ``[B, T]`` unless noted).

    ``logprobs`` (and ``entropy`` / ``sft_logprobs``) carry the graph; the other
    tensors are treated as constants (they are detached inside the objectives).
    ``advantages`` is ``[B]`` (one value per sequence) or ``[B, T]`` (per token).
    ``old_logprobs`` are the trainer's log-probs of the behaviour policy,
    ``rollout_logprobs`` the inference engine's; their gap is what the mismatch
    correction acts on. ``sft_logprobs``/``sft_mask`` (``[B', T']``) are the expert
    stream of CHORD: log-probs of the demonstration tokens under the current policy.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    ref_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    sft_logprobs: Tensor | None = None
    sft_mask: Tensor | None = None


@dataclass
class ObjectiveConfig:
    """Hyper-parameters of the objectives (all plain values; validated on creation).

    * ``clip_eps_low``/``clip_eps_high``: PPO trust region ``[1 - low, 1 + high]``
      (asymmetric "clip-higher" when they differ).
    * ``dual_clip_c``: dual-clip bound (> 1) on the loss of negative-advantage
      tokens; ``None`` disables it.
    * ``kl_beta``/``kl_estimator``/``kl_clamp``: KL(π‖π_ref) penalty weight,
      estimator name (k1/k2/k3), and symmetric clamp on the per-token estimate.
    * ``entropy_coef``: weight of the entropy bonus (subtracted from the loss).
    * ``correction_*``: rollout↔trainer mismatch correction (see ``common.py``).
    * ``log_ratio_clamp``: every log-ratio is clamped to ±this before ``exp``.
    * CHORD: ``mu_*`` schedule, ``chord_phi`` token weights, ``rl_objective`` (name
      of the RL part), ``sft_loss_agg_mode`` (aggregation of the expert NLL).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    loss_agg_mode: str = "token-mean"
    kl_beta: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: float | None = None
    entropy_coef: float = 0.0
    correction_mode: str = "none"
    correction_cap: float = 2.0
    correction_threshold: float = 2.0
    correction_seq_mean: bool = False
    log_ratio_clamp: float = 20.0
    mu_peak: float = 0.9
    mu_valley: float = 0.05
    mu_warmup_steps: int = 0
    mu_decay_steps: int = 0
    chord_phi: bool = False
    rl_objective: str = "grpo"
    sft_loss_agg_mode: str = "token-mean"

    def __post_init__(self) -> None:
        _require(self.clip_eps_low >= 0 and self.clip_eps_high >= 0, "clip eps must be >= 0")
        _require(self.clip_eps_low < 1, "clip_eps_low must be < 1 (ratio bound 1 - eps > 0)")
        _require(
            self.dual_clip_c is None or self.dual_clip_c > 1.0, "dual_clip_c must be > 1"
        )
        _require(self.kl_clamp is None or self.kl_clamp > 0, "kl_clamp must be > 0")
        _require(self.correction_cap > 0, "correction_cap must be > 0")
        _require(self.correction_threshold >= 1.0, "correction_threshold must be >= 1")
        _require(self.log_ratio_clamp > 0, "log_ratio_clamp must be > 0")
        _require(0 <= self.mu_valley <= 1 and 0 <= self.mu_peak <= 1, "mu must be in [0, 1]")
        _require(self.mu_warmup_steps >= 0 and self.mu_decay_steps >= 0, "mu steps must be >= 0")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class LossOutput:
    """A differentiable scalar loss plus additive metrics.

    ``loss`` is this micro-batch's SUM divided by the global denominators, so the
    losses of all micro-batches (and DP ranks) add up to the global loss. The
    metric naming convention that :func:`reduce_metrics` relies on is described in
    ``megatron_rl/objectives/metrics.py``.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)

