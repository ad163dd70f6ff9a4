"""Objectives vs independent float64 references written as plain loops.

The reference builds the loss one token at a time from scalar autograd tensors
and Python control flow (explicit branch selection instead of max/clamp), so the
vectorized implementation is checked against the formulas, not against itself.
Tolerance: 1e-10 absolute in float64 for values and gradients.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor

from megatron_rl.config import load_recipe
from megatron_rl.config.schema import AlgorithmConfig, ChordConfig, CorrectionConfig
from megatron_rl.objectives import (
    GlobalDenominators,
    LossInputs,
    available_aggregations,
    available_objectives,
    get_objective,
    mu_schedule,
    phi_weights,
    reduce_metrics,
)
from megatron_rl.objectives.common import KL_ESTIMATORS, kl_estimate

TOL = 1e-10
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
CORRECTIONS = ["none", "tis_token", "tis_seq", "mask_token", "mask_seq"]
MAX_LEN = 9


# ---------------------------------------------------------------- reference


def v(x: Tensor | float) -> float:
    return float(x.detach()) if isinstance(x, Tensor) else float(x)


def ref_ppo(r: Tensor, a: float, lo: float, hi: float, c: float | None) -> Tensor:
    unclipped = -a * r
    bounded = r if lo <= v(r) <= hi else torch.tensor(lo if v(r) < lo else hi, dtype=r.dtype)
    clipped = -a * bounded
    loss = unclipped if v(unclipped) >= v(clipped) else clipped
    if c is not None and a < 0 and -a * c < v(loss):
        loss = torch.tensor(-a * c, dtype=r.dtype)
    return loss


def ref_kl(delta: Tensor, estimator: str, clamp: float | None) -> Tensor:
    value = {
        "k1": lambda d: d,
        "k2": lambda d: 0.5 * d * d,
        "k3": lambda d: torch.exp(-d) + d - 1.0,
    }[estimator](delta)
    if clamp is not None and abs(v(value)) > clamp:
        value = torch.tensor(math.copysign(clamp, v(value)), dtype=delta.dtype)
    return value


def ref_correction(d: dict, cfg: AlgorithmConfig, b: int, valid: list[int]) -> list[float]:
    """Per-token weights of sequence b for the valid positions."""
    deltas = [float(d["old"][b, t] - d["rollout"][b, t]) for t in valid]
    mode, cap, thr = cfg.correction.mode, cfg.correction.cap, cfg.correction.threshold
    seq = sum(deltas) / (len(deltas) if cfg.correction.seq_mean else 1) if deltas else 0.0
    if mode == "none":
        return [1.0] * len(valid)
    if mode == "tis_token":
        return [min(math.exp(x), cap) for x in deltas]
    if mode == "tis_seq":
        return [min(math.exp(seq), cap)] * len(valid)
    if mode == "mask_token":
        return [1.0 if 1 / thr <= math.exp(x) <= thr else 0.0 for x in deltas]
    return [1.0 if 1 / thr <= math.exp(seq) <= thr else 0.0] * len(valid)


def ref_pg_tokens(name: str, d: dict, cfg: AlgorithmConfig, b: int, valid: list[int]) -> list[Tensor]:
    lp, old = d["logp"], d["old"]
    lo, hi, c = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high, cfg.dual_clip_c
    adv = d["adv"]
    if name == "grpo":
        return [ref_ppo(torch.exp(lp[b, t] - old[b, t]), float(adv[b, t]), lo, hi, c) for t in valid]
    log_s = sum(lp[b, t] - old[b, t] for t in valid) / len(valid)
    if name == "gspo":
        a_seq = sum(float(adv[b, t]) for t in valid) / len(valid)
        return [ref_ppo(torch.exp(log_s), a_seq, lo, hi, c)] * len(valid)
    s_const = math.exp(v(log_s))
    return [ref_ppo(s_const * torch.exp(lp[b, t] - v(lp[b, t])), float(adv[b, t]), lo, hi, c) for t in valid]


def ref_aggregate(per_seq_tokens: list[list[Tensor]], mode: str, n_tok: float, n_seq: float) -> Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for tokens in per_seq_tokens:
        if not tokens:
            continue
        seq_sum = sum(tokens)
        total = total + {
            "token-mean": seq_sum / n_tok,
            "seq-mean-token-mean": seq_sum / len(tokens) / n_seq,
            "seq-mean-token-sum": seq_sum / n_seq,
            "seq-mean-token-sum-norm": seq_sum / (n_seq * MAX_LEN),
        }[mode]
    return total


def ref_rl_loss(name: str, d: dict, cfg: AlgorithmConfig) -> Tensor:
    mask = d["mask"]
    n_tok = sum(1.0 for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t] > 0)
    n_seq = sum(1.0 for b in range(mask.shape[0]) if any(mask[b, t] > 0 for t in range(mask.shape[1])))
    per_seq = []
    for b in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[b, t] > 0]
        if not valid:
            per_seq.append([])
            continue
        pg = ref_pg_tokens(name, d, cfg, b, valid)
        w = ref_correction(d, cfg, b, valid)
        tokens = []
        for k, t in enumerate(valid):
            kl = ref_kl(d["logp"][b, t] - d["ref"][b, t], cfg.kl_estimator, cfg.kl_clamp)
            tokens.append(w[k] * pg[k] + cfg.kl_beta * kl - cfg.entropy_coef * d["entropy"][b, t])
        per_seq.append(tokens)
    return ref_aggregate(per_seq, cfg.loss_agg_mode, n_tok, n_seq)


def ref_mu(step: int, peak: float, valley: float, warm: int, decay: int) -> float:
    if step <= warm:
        return peak * step / warm if warm else peak
    if step >= warm + decay:
        return valley
    return valley + (peak - valley) * (1 + math.cos(math.pi * (step - warm) / decay)) / 2


def ref_sft(d: dict, cfg: AlgorithmConfig) -> Tensor:
    lp, mask = d["sft_logp"], d["sft_mask"]
    n_tok = float((mask > 0).sum())
    n_seq = float((mask > 0).any(dim=1).sum())
    per_seq = []
    for b in range(lp.shape[0]):
        tokens = []
        for t in range(lp.shape[1]):
            if mask[b, t] > 0:
                p = math.exp(v(lp[b, t]))
                tokens.append(-(p * (1 - p) if cfg.chord.phi else 1.0) * lp[b, t])
        per_seq.append(tokens)
    return ref_aggregate(per_seq, cfg.chord.sft_loss_agg_mode, n_tok, n_seq)


def ref_loss(name: str, d: dict, cfg: AlgorithmConfig, step: int) -> Tensor:
    if name != "chord":
        return ref_rl_loss(name, d, cfg)
    c = cfg.chord
    mu = ref_mu(step, c.mu_peak, c.mu_valley, c.mu_warmup_steps, c.mu_decay_steps)
    return (1 - mu) * ref_rl_loss(c.rl_objective, d, cfg) + mu * ref_sft(d, cfg)


# ------------------------------------------------------------------ fixtures


def make_data(seed: int, per_token_adv: bool = True) -> dict:
    """Ragged float mask (one empty row), ratios spread to hit every clip branch."""
    gen = torch.Generator().manual_seed(seed)
    b, t = 5, 7
    lengths = [7, 3, 0, 5, 1]
    mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(t)] for n in lengths], dtype=torch.float64)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3 - 0.05
    # Log-ratios of std 1: ratios from ~0.1 to ~10 (low, high and dual clips all occur).
    logp = old + torch.randn(b, t, generator=gen, dtype=torch.float64)
    logp = torch.where(mask > 0, logp, torch.full_like(logp, -7.5))  # finite garbage on padding
    rollout = old + 0.4 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    rollout[3] -= 0.3  # a sequence far off: sequence-level masking/truncation always acts
    ref = old + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    entropy = torch.rand(b, t, generator=gen, dtype=torch.float64) * 2
    adv_seq = torch.randn(b, generator=gen, dtype=torch.float64)
    noise = 0.5 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = adv_seq[:, None] + (noise if per_token_adv else torch.zeros_like(noise))
    if per_token_adv:
        # Planted tokens so every fixture has a dual clip, a low clip and a high clip.
        logp.data[0, :3] = old[0, :3] + torch.tensor([1.5, -1.0, 0.8], dtype=torch.float64)
        adv[0, :3] = torch.tensor([-0.7, -1.1, 0.9], dtype=torch.float64)
    sft_lengths = [6, 2, 4]
    sft_mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(6)] for n in sft_lengths], dtype=torch.float64)
    sft_logp = -torch.rand(3, 6, generator=gen, dtype=torch.float64) * 2.5 - 0.01
    return {
        "logp": logp.requires_grad_(), "old": old, "rollout": rollout, "ref": ref,
        "entropy": entropy.requires_grad_(), "adv": adv, "adv_seq": adv_seq, "mask": mask,
        "sft_logp": sft_logp.requires_grad_(), "sft_mask": sft_mask,
    }


def inputs_of(d: dict, adv: Tensor | None = None) -> LossInputs:
    return LossInputs(
        logprobs=d["logp"], old_logprobs=d["old"], advantages=d["adv"] if adv is None else adv,
        mask=d["mask"], ref_logprobs=d["ref"], rollout_logprobs=d["rollout"], entropy=d["entropy"],
        sft_logprobs=d["sft_logp"], sft_mask=d["sft_mask"],
    )


def denoms_of(mask: Tensor) -> GlobalDenominators:
    return GlobalDenominators(float((mask > 0).sum()), float((mask > 0).any(dim=1).sum()), MAX_LEN)


def base_config(correction: str = "none", chord: dict | None = None, **overrides: object) -> AlgorithmConfig:
    """The recipe's own AlgorithmConfig; kl_clamp 1e6 leaves the KL unclamped (its own test clamps)."""
    cfg = AlgorithmConfig(
        clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0, kl_beta=0.1, kl_estimator="k3",
        kl_clamp=1e6, entropy_coef=0.01, correction=CorrectionConfig(mode=correction, cap=1.5, threshold=1.6),
        chord=ChordConfig(**{"mu_peak": 0.8, "mu_valley": 0.1, "mu_warmup_steps": 4, "mu_decay_steps": 10,
                             "phi": True, **(chord or {})}),
    )
    return replace(cfg, **overrides)


def grads(loss: Tensor, d: dict) -> list[Tensor]:
    leaves = [d["logp"], d["entropy"], d["sft_logp"]]
    out = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, out)]


OBJECTIVE_CASES = [
    ("grpo", {}),
    ("gspo", {}),
    ("gspo_token", {}),
    ("chord", {"chord": {"rl_objective": "grpo"}}),
    ("chord", {"chord": {"rl_objective": "gspo", "phi": False, "sft_loss_agg_mode": "seq-mean-token-mean"}}),
]


# --------------------------------------------------------------------- tests


def case_seed(mode: str, correction: str) -> int:
    return 10 * MODES.index(mode) + CORRECTIONS.index(correction)


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "extra"), OBJECTIVE_CASES, ids=lambda x: str(x))
def test_value_and_gradient_match_reference(name: str, extra: dict, mode: str, correction: str) -> None:
    d = make_data(seed=case_seed(mode, correction))
    cfg = base_config(correction, loss_agg_mode=mode, **extra)
    step = 7
    denoms = denoms_of(d["mask"])
    out = get_objective(name)(inputs_of(d), cfg, denoms, step=step, sft_denoms=denoms_of(d["sft_mask"]))
    expected = ref_loss(name, d, cfg, step)
    assert abs(v(out.loss) - v(expected)) <= TOL
    for got, want in zip(grads(out.loss, d), grads(expected, d)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert float(out.metrics["loss/total"]) == pytest.approx(v(out.loss), abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_reference_fixtures_hit_every_branch(mode: str) -> None:
    """Guard on the fixtures: each exercises low, high and dual clips and the corrections."""
    for correction in CORRECTIONS:
        d = make_data(seed=case_seed(mode, correction))
        out = get_objective("grpo")(inputs_of(d), base_config(correction), denoms_of(d["mask"]))
        counts = {k: float(out.metrics[f"token/{k}_count"]) for k in ("clip_low", "clip_high", "dual_clip")}
        assert all(c > 0 for c in counts.values()), (correction, counts)
        weights = out.metrics.get("token/is_weight_min"), out.metrics.get("token/is_weight_max")
        if correction != "none":
            assert float(weights[0]) < float(weights[1]), correction  # weights are not all equal


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("correction", ["none", "tis_seq"])
def test_gspo_token_equals_gspo_with_constant_advantage(mode: str, correction: str) -> None:
    d = make_data(seed=11, per_token_adv=False)
    cfg = base_config(correction, loss_agg_mode=mode, clip_eps_low=3e-1, clip_eps_high=4e-1)
    denoms = denoms_of(d["mask"])
    seq = get_objective("gspo")(inputs_of(d, adv=d["adv_seq"]), cfg, denoms)
    tok = get_objective("gspo_token")(inputs_of(d, adv=d["adv"]), cfg, denoms)
    assert abs(v(seq.loss) - v(tok.loss)) <= TOL
    for a, b in zip(grads(seq.loss, d), grads(tok.loss, d)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    assert float(seq.metrics["seq/ratio_sum"]) == pytest.approx(float(tok.metrics["seq/ratio_sum"]), abs=TOL)


def _single_sequence(ratios: list[float], adv: float) -> LossInputs:
    old = torch.full((1, len(ratios)), -1.0, dtype=torch.float64)
    logp = (old + torch.log(torch.tensor([ratios], dtype=torch.float64))).requires_grad_()
    return LossInputs(logp, old, torch.tensor([adv], dtype=torch.float64), torch.ones_like(old))


def test_gspo_worked_example_geometric_mean() -> None:
    ratios = [1.0, 1.1, 2.5, 0.9, 1.0]
    expected = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    assert expected == pytest.approx(1.19, abs=0.01)
    inp = _single_sequence(ratios, adv=1.0)
    cfg = AlgorithmConfig(clip_eps_low=0.5, clip_eps_high=0.5, loss_agg_mode="seq-mean-token-mean")
    out = get_objective("gspo")(inp, cfg, GlobalDenominators(5, 1, 5))
    assert float(out.metrics["seq/ratio_sum"]) == pytest.approx(expected, abs=1e-12)
    assert v(out.loss) == pytest.approx(-expected, abs=1e-12)  # unclipped: −A·s


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_small_epsilon_clips_ratio_1001_to_zero_gradient(name: str) -> None:
    cfg = AlgorithmConfig(clip_eps_low=3e-4, clip_eps_high=3e-4)
    inp = _single_sequence([1.001] * 4, adv=1.0)
    out = get_objective(name)(inp, cfg, GlobalDenominators(4, 1, 4))
    (g,) = torch.autograd.grad(out.loss, inp.logprobs)
    assert torch.all(g == 0)
    unit = "seq" if name == "gspo" else "token"
    stats = reduce_metrics([out.metrics])
    assert stats[f"{unit}/clip_high_count"] == (1 if unit == "seq" else 4)
    assert stats[f"{unit}/clip_high_frac"] == 1.0
    # Just inside the trust region the gradient is back.
    inside = _single_sequence([1.0002] * 4, adv=1.0)
    (g_in,) = torch.autograd.grad(get_objective(name)(inside, cfg, GlobalDenominators(4, 1, 4)).loss, inside.logprobs)
    assert torch.all(g_in < 0)


def test_asymmetric_clip_fractions() -> None:
    ratios = torch.tensor([[0.85, 0.85, 1.2, 1.35, 1.2]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    old = torch.zeros_like(ratios) - 1
    logp = (old + ratios.log()).requires_grad_()
    cfg = AlgorithmConfig(clip_eps_low=0.1, clip_eps_high=0.3)
    out = get_objective("grpo")(LossInputs(logp, old, adv, torch.ones_like(old)), cfg, GlobalDenominators(5, 1, 5))
    stats = reduce_metrics([out.metrics])
    assert stats["token/clip_low_count"] == 1 and stats["token/clip_high_count"] == 1
    assert stats["token/clip_low_frac"] == pytest.approx(0.2) and stats["token/clip_high_frac"] == pytest.approx(0.2)
    (g,) = torch.autograd.grad(out.loss, logp)
    assert (g[0] == 0).tolist() == [True, False, False, True, False]


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    ratios = torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64)
    adv = torch.tensor([[-2.0, -2.0, 2.0]], dtype=torch.float64)
    old = torch.zeros_like(ratios) - 2
    denoms = GlobalDenominators(3, 1, 3)

    def run(c: float | None) -> tuple[Tensor, Tensor, dict[str, float]]:
        logp = (old + ratios.log()).requires_grad_()
        cfg = AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=c, loss_agg_mode="seq-mean-token-sum")
        out = get_objective("grpo")(LossInputs(logp, old, adv, torch.ones_like(old)), cfg, denoms)
        return out.loss, torch.autograd.grad(out.loss, logp)[0], reduce_metrics([out.metrics])

    loss_dc, g_dc, stats = run(3.0)
    loss_plain, g_plain, _ = run(None)
    # token 0: A=−2, r=5 > c=3 → loss capped at −A·c = 6 instead of −A·r = 10, zero gradient.
    # token 1: r=2 < c → unaffected; token 2: positive advantage, clipped high either way.
    assert v(loss_plain) == pytest.approx(10 + 4 - 2 * 1.2)
    assert v(loss_dc) == pytest.approx(6 + 4 - 2 * 1.2)
    assert g_dc[0, 0] == 0 and g_plain[0, 0] != 0
    assert g_dc[0, 1] == g_plain[0, 1] != 0
    assert stats["token/dual_clip_count"] == 1


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_formulas(estimator: str) -> None:
    gen = torch.Generator().manual_seed(5)
    logp = -torch.rand(50, generator=gen, dtype=torch.float64) * 4
    ref = -torch.rand(50, generator=gen, dtype=torch.float64) * 4
    got = kl_estimate(logp, ref, estimator, None, 20.0)
    formulas = {
        "k1": [a - b for a, b in zip(logp.tolist(), ref.tolist())],
        "k2": [0.5 * (a - b) ** 2 for a, b in zip(logp.tolist(), ref.tolist())],
        "k3": [math.exp(b - a) - (b - a) - 1 for a, b in zip(logp.tolist(), ref.tolist())],
    }
    torch.testing.assert_close(got, torch.tensor(formulas[estimator], dtype=torch.float64), atol=1e-13, rtol=0)
    if estimator == "k3":
        assert torch.all(got >= 0)


def test_kl_clamp_bounds_values_and_stops_gradient() -> None:
    logp = torch.tensor([-0.1, -6.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-6.0, -0.1, -1.2], dtype=torch.float64)
    kl = kl_estimate(logp, ref, "k3", 2.0, 20.0)
    values = kl.detach()
    assert float(values[0]) == pytest.approx(2.0) and float(values[1]) == pytest.approx(2.0)  # raw k3 ≈ 4.9 and ≈ 358
    assert 0 < float(values[2]) < 2.0
    (g,) = torch.autograd.grad(kl.sum(), logp)
    assert g[0] == 0 and g[1] == 0 and g[2] != 0
    k1 = kl_estimate(logp, ref, "k1", 2.0, 20.0)
    assert float(k1.detach()[1]) == pytest.approx(-2.0)


def test_mu_schedule_boundaries() -> None:
    kw = dict(mu_peak=0.9, mu_valley=0.05, warmup_steps=10, decay_steps=20)
    assert mu_schedule(0, **kw) == 0.0
    assert mu_schedule(5, **kw) == pytest.approx(0.45)
    assert mu_schedule(10, **kw) == pytest.approx(0.9)
    assert mu_schedule(20, **kw) == pytest.approx(0.05 + 0.85 * 0.5)  # cosine midpoint
    assert mu_schedule(30, **kw) == pytest.approx(0.05)
    assert mu_schedule(1000, **kw) == pytest.approx(0.05)
    assert mu_schedule(0, 0.9, 0.05, 0, 20) == pytest.approx(0.9)  # no warm-up starts at the peak
    assert mu_schedule(0, 0.9, 0.05, 0, 0) == pytest.approx(0.05)
    for step in range(35):
        assert mu_schedule(step, **kw) == pytest.approx(ref_mu(step, 0.9, 0.05, 10, 20), abs=1e-15)


def test_chord_mu_counts_optimizer_steps() -> None:
    from megatron_rl.objectives.chord import optimizer_step

    spg = 5  # the published GRPO/CHORD steps_per_generation
    seen = [optimizer_step(step, spg, i) for step in range(1, 5) for i in range(spg)]
    assert seen == list(range(20))  # contiguous across rollout steps, one per update
    # decay_steps 500 ends after 500 updates = 100 rollout steps, not 500 rollout steps.
    assert mu_schedule(optimizer_step(101, spg, 0), 0.1, 0.01, 0, 500) == pytest.approx(0.01)
    at_100 = optimizer_step(21, spg, 0)
    assert at_100 == 100
    expected = 0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * 100 / 500))  # 0.0914
    assert mu_schedule(at_100, 0.1, 0.01, 0, 500) == pytest.approx(expected, abs=1e-15)


def test_phi_weights_peak_at_half() -> None:
    p = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    phi = phi_weights(p.log().requires_grad_())
    assert not phi.requires_grad
    assert float(p[int(phi.argmax())]) == pytest.approx(0.5)
    assert float(phi.max()) == pytest.approx(0.25)
    torch.testing.assert_close(phi, p * (1 - p), atol=1e-15, rtol=0)


def test_tis_caps_weights_and_detaches_them() -> None:
    d = make_data(seed=21)
    old = d["old"].clone().requires_grad_()
    rollout = d["rollout"].clone().requires_grad_()
    inp = replace(inputs_of(d), old_logprobs=old, rollout_logprobs=rollout, ref_logprobs=None, entropy=None)
    cfg = AlgorithmConfig(correction=CorrectionConfig(mode="tis_token", cap=1.2))
    out = get_objective("grpo")(inp, cfg, denoms_of(d["mask"]))
    stats = reduce_metrics([out.metrics])
    assert stats["token/is_weight_max"] == pytest.approx(1.2)
    raw = torch.exp(d["old"] - d["rollout"])[d["mask"] > 0]
    assert stats["token/tis_truncated_count"] == int((raw > 1.2).sum()) > 0
    assert stats["token/mismatch_abs_max"] == pytest.approx(float((d["old"] - d["rollout"]).abs()[d["mask"] > 0].max()))
    out.loss.backward()
    assert old.grad is None and rollout.grad is None
    assert d["logp"].grad is not None


@pytest.mark.parametrize("mode", ["mask_token", "mask_seq"])
def test_masking_removes_tokens(mode: str) -> None:
    d = make_data(seed=8)
    inp = replace(inputs_of(d), ref_logprobs=None, entropy=None)
    cfg = AlgorithmConfig(correction=CorrectionConfig(mode=mode, threshold=1.3))
    out = get_objective("grpo")(inp, cfg, denoms_of(d["mask"]))
    (g,) = torch.autograd.grad(out.loss, d["logp"])
    delta = d["old"] - d["rollout"]
    valid = d["mask"] > 0
    if mode == "mask_token":
        dropped = valid & (delta.abs() > math.log(1.3))
        assert float(out.metrics["token/masked_count"]) == int(dropped.sum()) > 0
    else:
        seq = torch.where(valid, delta, 0.0).sum(dim=1, keepdim=True)
        dropped = valid & (seq.abs() > math.log(1.3))
        assert float(out.metrics["seq/masked_count"]) == int(dropped.any(dim=1).sum()) > 0
    assert torch.all(g[dropped] == 0)
    assert torch.any(g[valid & ~dropped] != 0)


def test_reduce_metrics_means_fractions_and_extrema() -> None:
    m1 = {"token/count": torch.tensor(2.0), "token/ratio_sum": torch.tensor(3.0), "token/ratio_min": torch.tensor(0.5),
          "token/clip_high_count": torch.tensor(1.0), "loss/pg": torch.tensor(0.25), "const/mu": torch.tensor(0.3)}
    m2 = {"token/count": torch.tensor(6.0), "token/ratio_sum": torch.tensor(5.0), "token/ratio_min": torch.tensor(0.2),
          "token/clip_high_count": torch.tensor(1.0), "loss/pg": torch.tensor(0.5), "const/mu": torch.tensor(0.3)}
    stats = reduce_metrics([m1, m2])
    assert stats["token/ratio_mean"] == pytest.approx(1.0)
    assert stats["token/ratio_min"] == pytest.approx(0.2)
    assert stats["token/clip_high_frac"] == pytest.approx(0.25)
    assert stats["loss/pg"] == pytest.approx(0.75)
    assert stats["const/mu"] == pytest.approx(0.3)
    empty = reduce_metrics([{"seq/count": torch.tensor(0.0), "seq/ratio_max": torch.tensor(-math.inf)}])
    assert math.isnan(empty["seq/ratio_max"])
    with pytest.raises(ValueError, match="does not follow"):
        reduce_metrics([{"token/ratio": torch.tensor(1.0)}])


def test_registry_errors_list_allowed_names() -> None:
    assert available_objectives() == ["chord", "grpo", "gspo", "gspo_token"]
    with pytest.raises(ValueError, match="allowed: chord, grpo, gspo, gspo_token"):
        get_objective("ppo")
    d = make_data(seed=1)
    denoms = denoms_of(d["mask"])
    with pytest.raises(ValueError, match=", ".join(available_aggregations())):
        get_objective("grpo")(inputs_of(d), base_config(loss_agg_mode="mean"), denoms)
    with pytest.raises(ValueError, match=", ".join(KL_ESTIMATORS.names())):
        get_objective("grpo")(inputs_of(d), base_config(kl_estimator="k4"), denoms)
    with pytest.raises(ValueError, match="mask_seq, mask_token, none, tis_seq, tis_token"):
        get_objective("grpo")(inputs_of(d), base_config("is"), denoms)


def test_missing_inputs_and_bad_config_are_rejected() -> None:
    d = make_data(seed=2)
    denoms = denoms_of(d["mask"])
    with pytest.raises(ValueError, match="ref_logprobs"):
        get_objective("grpo")(replace(inputs_of(d), ref_logprobs=None), base_config(), denoms)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        get_objective("grpo")(replace(inputs_of(d), rollout_logprobs=None), base_config("tis_token"), denoms)
    with pytest.raises(ValueError, match="sft"):
        get_objective("chord")(inputs_of(d), base_config(), denoms)
    with pytest.raises(ValueError, match="itself"):
        get_objective("chord")(inputs_of(d), base_config(chord={"rl_objective": "chord"}), denoms, sft_denoms=denoms)
    with pytest.raises(ValueError, match="dual_clip_c"):           # the recipe loader checks ranges
        load_recipe(Path(__file__).parents[2] / "recipes/tiny/grpo.yaml", ["algorithm.dual_clip_c=0.5"])
