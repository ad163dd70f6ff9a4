"""The planner's LoRA / QLoRA model against hand arithmetic, and its answer to the published
question: the fewest 8-GPU 80 GB nodes for Qwen3-235B-A22B GSPO with LoRA and with QLoRA."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.config.rules import lint
from megatron_rl.nf4 import nf4_bytes, nf4_bytes_per_param
from megatron_rl.planner.host import owner_copy_bytes
from megatron_rl.planner.lora import dequantize_bytes_per_param, total_adapter_params
from megatron_rl.planner.memory import GB, Hardware
from megatron_rl.planner.modes import compare, with_nodes
from megatron_rl.planner.params import count_params
from megatron_rl.planner.plan import estimate, search

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes/qwen3_235b_a22b/gspo_qlora.yaml"
Q235 = json.loads((REPO / "recipes/models/qwen3_235b_a22b/config.json").read_text())
HW = Hardware(8, 80.0)
REL = 1e-9

# Qwen3-235B-A22B by hand: hidden 4096, 64 query heads and 4 KV heads of 128, 128 experts of width
# 1536, 94 layers, vocab 151936, untied embedding/output.
H, Q_OUT, KV_OUT, LAYERS, VOCAB = 4096, 64 * 128, 4 * 128, 94, 151936
ATTENTION = H * (Q_OUT + 2 * KV_OUT) + Q_OUT * H             # q, k, v, o weights
EXPERTS = 128 * 3 * H * 1536                                # gate, up, down of every expert
REPLICATED = 2 * 128 + 128 * H + 2 * H                      # q/k norms, router, two RMSNorms
R = 8


def test_adapter_count_by_hand() -> None:
    # PEFT on q_proj, k_proj, v_proj, o_proj: A [r × in], B [out × r] each.
    per_layer = R * (H + Q_OUT) + 2 * R * (H + KV_OUT) + R * (Q_OUT + H)
    assert per_layer == 270_336
    assert total_adapter_params(count_params(Q235), R, ("q", "k", "v", "o")) == LAYERS * per_layer
    assert total_adapter_params(count_params(Q235), R, ("q", "v")) == LAYERS * R * (2 * H + Q_OUT + KV_OUT)


def test_nf4_bytes_by_hand() -> None:
    # 4-bit codes, one int8 scale per 64 weights, one bf16 factor per 256 scales.
    assert nf4_bytes(64 * 256, 2) == 8192 + 256 + 2
    assert nf4_bytes_per_param(2) == pytest.approx(0.5 + 1 / 64 + 2 / (64 * 256), rel=1e-15)
    assert nf4_bytes(64 * 6, 4) == 192 + 6 + 4               # 6 blocks: one factor for all six


def test_qlora_recipe_layout_terms_by_hand() -> None:
    cfg = load_recipe(RECIPE)
    p = cfg.parallelism
    assert (p.nodes, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
            p.expert_model_parallel_size, p.expert_tensor_parallel_size) == (1, 4, 1, 8, 1)
    est = estimate(cfg, count_params(Q235), HW)
    terms = {t.key: t.gb * GB for t in est.stage.terms}
    # One GPU of TP 4 × EP 8: a quarter of every attention projection and 16 of the 128 experts in
    # NF4; a quarter of the embedding and the output layer, norms and router in bf16.
    quantized = LAYERS * (ATTENTION / 4 + EXPERTS / 8)
    bf16 = LAYERS * REPLICATED + 2 * VOCAB * H / 4 + H
    # Adapters: q/k/v's A replicated, B split over TP; o's A split, B replicated.
    adapters = LAYERS * (3 * R * H + R * (Q_OUT + 2 * KV_OUT) / 4 + R * Q_OUT / 4 + R * H)
    assert adapters == 15_593_472
    assert terms["weights"] == pytest.approx(2 * bf16 + quantized * nf4_bytes_per_param(2) + 2 * adapters, rel=REL)
    assert terms["gradients"] == pytest.approx(4 * adapters, rel=REL)                # fp32 main grads
    assert terms["optimizer"] == pytest.approx(12 * adapters / 2, rel=REL)           # Adam + master, DP 2
    assert terms["reference"] == 0                       # β 0; with LoRA it would be the base anyway
    # The largest linear dequantized at a time: an expert's fc1 (2 × 4096 × 1536 = 12.6 M weights),
    # over this GPU's quarter of linear_qkv (4096 × 9216 / 4 = 9.4 M): the QLoRA spec's SequentialMLP
    # dequantizes one expert at a time, through torchao's decoder (int64 codes + 3 bf16 copies).
    assert dequantize_bytes_per_param(2) == 8 + 3 * 2
    assert terms["dequantized"] == pytest.approx((8 + 3 * 2) * 2 * H * 1536, rel=REL)
    assert terms["weights"] / GB == pytest.approx(16.3, abs=0.05)
    # LoRA dropout 0.05: per token and attention layer, q, k and v each keep a dropped bf16 copy of
    # the SP chunk of the input and its bool mask (3 bytes × H / TP), o one of its TP share of the
    # attention output — at 4500 tokens (2500 prompt cap + 2000), 94 layers kept plus one layer's
    # backward working set:
    dropout = 3 * (3 * H / 4 + Q_OUT / 4) * 4500 * (LAYERS + 1)
    no_dropout = estimate(load_recipe(RECIPE, ["lora.dropout=0.0"]), count_params(Q235), HW)
    without = {t.key: t.gb * GB for t in no_dropout.stage.terms}
    assert terms["activations"] - without["activations"] == pytest.approx(dropout, rel=1e-6)
    assert dropout / GB == pytest.approx(6.6, abs=0.05)


def test_qlora_first_sync_sends_the_whole_base() -> None:
    """audit-5 #3: the first QLoRA sync sends every tensor, dequantized (`sync/lora.py::sync_actor`),
    later ones the merged attention tensors only: the host term holds the first, the time note says it."""
    from megatron_rl.planner.gpus import GPUS
    from megatron_rl.planner.host import first_sync_bytes, sync_bytes
    from megatron_rl.planner.memory import rollout_memory
    from megatron_rl.planner.timing import sync_seconds

    params = count_params(Q235)
    for overrides in ([], ["rollout.placement=colocated", "rollout.nodes=0"]):
        cfg = load_recipe(RECIPE, overrides)
        later = LAYERS * (ATTENTION + 2 * 128) * 2               # q/k/v/o and the q/k norms, bf16
        assert sync_bytes(params, cfg) == later and later / GB == pytest.approx(13.4, abs=0.05)
        assert first_sync_bytes(params, cfg) == params.total * 2 and params.total * 2 / GB == pytest.approx(470.2, 1e-3)
        est = estimate(cfg, params, HW)
        (segments,) = [t for t in est.nodes[0].host_terms if t.key == "sync_segments"]
        # In RAM either way: a lone server's /dev/shm segments (the whole base), or (rollout nodes,
        # over the network) rank 0's node's owners' copies to compare the deltas with (its share).
        held = max(owner_copy_bytes(params, cfg, by_node=True).values()) if overrides == [] else params.total * 2
        assert segments.gb == pytest.approx(held / GB) and not segments.reclaimable
        assert "then 13.4 GB" in segments.note
        phase = sync_seconds(params, cfg, rollout_memory(params, cfg, HW), GPUS["H100"], HW)
        assert "13.4 GB" in phase.note and "the first sync sends the whole base: 470.2 GB" in phase.note
    # LoRA on a bf16 base: the server starts from the same base, every sync is the touched tensors.
    lora = load_recipe(RECIPE, ["lora.base_quantization=none"])
    assert first_sync_bytes(params, lora) == sync_bytes(params, lora)
    assert "first sync" not in sync_seconds(params, lora, rollout_memory(params, lora, HW), GPUS["H100"], HW).note


def test_qlora_start_up_and_sync_peaks_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    """audit-5 #8: QLoRA's GPU outside the step. Start-up: the stage is built in bf16 and quantized
    after, so the whole bf16 base (+ adapters) is there once, with the overhead, before any server
    starts. Each sync: `merged_deltas` holds q/k/v/o densely twice (dequantized + the saved copy)
    next to what stays resident (not the step's activations, logits, log-probs)."""
    cfg = load_recipe(RECIPE)
    est = estimate(cfg, count_params(Q235), HW)
    peaks = {t.key: t.gb * GB for t in est.peaks}
    bf16 = LAYERS * REPLICATED + 2 * VOCAB * H / 4 + H
    quantized = LAYERS * (ATTENTION / 4 + EXPERTS / 8)
    adapters = 15_593_472
    assert peaks["startup"] == pytest.approx(2 * (bf16 + quantized + adapters) + 4e9, rel=REL)
    assert (peaks["startup"] - 4e9) / GB == pytest.approx(60.9, abs=0.05)
    terms = {t.key: t.gb * GB for t in est.stage.terms}
    resident = sum(terms[k] for k in ("weights", "gradients", "optimizer", "reference", "vllm", "overhead",
                                      "sync_gather"))
    copies = 2 * 2 * LAYERS * ATTENTION / 4                    # two bf16 copies of this GPU's q/k/v/o
    assert peaks["sync_copies"] == pytest.approx(resident + copies, rel=REL)
    assert copies / GB == pytest.approx(6.7, abs=0.05)
    assert est.fits and est.comfortable                        # 64.9 GB at start-up: under 90 % of 80
    # LoRA on a bf16 base: no start-up peak (the base stays as built); one saved copy at a sync.
    lora = estimate(load_recipe(RECIPE, ["lora.base_quantization=none"]), count_params(Q235), HW)
    assert [t.key for t in lora.peaks] == ["sync_copies"]
    lora_terms = {t.key: t.gb * GB for t in lora.stage.terms}
    assert lora.peaks[0].gb * GB == pytest.approx(
        sum(lora_terms[k] for k in ("weights", "gradients", "optimizer", "reference", "vllm", "overhead",
                                    "sync_gather")) + copies / 2, rel=REL)
    assert estimate(load_recipe(RECIPE, ["lora.rank=0", "lora.base_quantization=none"]),
                    count_params(Q235), HW).peaks == ()
    # TP 2 × EP 4 fits the step (NF4) but not its own start-up: a quarter of the experts in bf16.
    small = load_recipe(RECIPE, ["parallelism.tensor_model_parallel_size=2", "parallelism.expert_model_parallel_size=4",
                                 "parallelism.recompute_granularity=full"])
    tight = estimate(small, count_params(Q235), HW)
    assert tight.margin_gb > 0 and not tight.fits
    assert tight.peaks_over(80.0)[0].key == "startup" and tight.peaks_over(80.0)[0].gb > 100
    found = search(cfg, Q235, count_params(Q235), HW, limit=50)
    assert found and all(s.estimate.peaks_over(72.0) == [] for s in found)
    assert not any((s.parallelism.tensor_model_parallel_size, s.parallelism.expert_model_parallel_size,
                    s.parallelism.expert_tp, s.parallelism.pipeline_model_parallel_size) == (2, 4, 1, 1)
                   for s in found)                          # ETP 2 halves the experts again: that one fits
    # `plan` shows both lines, and the refusal says why; JSON has them.
    assert main(["plan", str(RECIPE)]) == 0
    out = capsys.readouterr().out
    assert "outside the step" in out and "start-up, before quantization" in out and "sync: dense adapted weights" in out
    assert main(["plan", str(RECIPE), "parallelism.tensor_model_parallel_size=2",
                 "parallelism.expert_model_parallel_size=4", "parallelism.recompute_granularity=full"]) == 2
    assert "DOES NOT FIT (start-up, before quantization:" in capsys.readouterr().out
    assert main(["plan", str(RECIPE), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["peaks_gb"]) == {"startup", "sync_copies"}


@pytest.fixture(scope="module")
def answers() -> dict:
    return {a.mode: a for a in compare(load_recipe(RECIPE), Q235, HW)}


def test_published_question_fewest_nodes(answers: dict) -> None:
    full, lora, qlora = answers["full"], answers["lora"], answers["qlora"]
    # Lower bounds by hand: what never leaves the GPU must fit in 90 % of 8 × 80 GB per node.
    params, budget = count_params(Q235).total, 8 * 80e9 * 0.9
    assert math.ceil(6 * params / budget) == 3            # full: bf16 weights + fp32 grads, Adam offloaded
    assert math.ceil(2 * params / budget) == 1            # LoRA: the frozen bf16 base
    assert full.trainer_nodes is not None and full.trainer_nodes >= 3
    assert lora.trainer_nodes == qlora.trainer_nodes == 1
    # Each answer is the fewest: one node less has no layout that fits.
    cfg = load_recipe(RECIPE)
    trial = dataclasses.replace(cfg, lora=full.lora)
    assert search(with_nodes(trial, full.trainer_nodes - 1), Q235, count_params(Q235), HW, limit=1) == ()
    # On that one node LoRA's bf16 base (58.8 GB of its 71.5) forces full recompute; QLoRA's
    # 4-bit base leaves room to keep every activation.
    assert 2 * params / 8 / GB == pytest.approx(58.8, abs=0.05)
    assert lora.best.parallelism.recompute_granularity == "full"
    assert qlora.best.parallelism.recompute_granularity == "none"
    assert qlora.best.estimate.total_gb < lora.best.estimate.total_gb <= 0.9 * 80
    # The rollout: one vLLM server of TP 4 × DP 2 on its own node holds the bf16 weights.
    assert lora.rollout_nodes == qlora.rollout_nodes == 1
    assert (lora.total_nodes, qlora.total_nodes) == (2, 2)


def test_the_qlora_recipe_is_the_planners_answer(answers: dict) -> None:
    cfg = load_recipe(RECIPE)
    q = answers["qlora"]
    assert (cfg.parallelism.nodes, cfg.rollout.nodes) == (q.trainer_nodes, q.rollout_nodes)
    best = q.best.parallelism
    own = cfg.parallelism
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                "expert_tensor_parallel_size", "recompute_granularity", "optimizer_cpu_offload"):
        assert getattr(own, key) == getattr(best, key), key
    assert q.own.fits and q.own.comfortable


def test_qlora_recipe_carries_the_published_run() -> None:
    cfg = load_recipe(RECIPE)
    a, r, t, lo = cfg.algorithm, cfg.rollout, cfg.trainer, cfg.lora
    assert cfg.task == "medmcqa" and "Thinking-2507" in str(cfg.model.init_checkpoint)
    assert (a.name, r.n, a.kl_beta, cfg.model.reference) == ("gspo", 2, 0.0, "none")
    assert (t.lr, r.temperature, r.top_p, r.max_response_length, t.max_steps) == (1e-5, 0.7, 0.9, 2000, 50)
    # steps_per_generation 2 in ms-swift counted micro-steps: one update per rollout here
    # (tests/unit/test_published_runs.py counts it as ms-swift did).
    assert (a.clip_eps_low, a.clip_eps_high, a.steps_per_generation) == (3e-4, 4e-4, 1)
    assert (lo.rank, lo.alpha, lo.targets, lo.base_quantization) == (8, 16.0, ["q", "k", "v", "o"], "nf4")
    assert (t.global_batch_size, t.lr_warmup_ratio, t.weight_decay, t.seed) == (4, 0.05, 0.01, 42)
    assert r.max_prompt_length == 2500                     # max_length 2500: the prompt cap in GRPO
    assert {k: v for k, v in cfg.rewards.weights.items() if v} == {"medmcqa_strict": 1.0}
    # A GPU job built from the QLoRA spec (tests/unit/test_gpu_refusals.py): no error.
    assert [f.rule for f in lint(cfg, check_paths=False) if f.level == "error"] == []


def test_cli_plan_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(RECIPE), "--modes"]) == 0
    out = capsys.readouterr().out
    assert "full / LoRA / QLoRA on 8-GPU 80 GB nodes" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("  full", "  lora", "  qlora"))}
    assert rows["qlora"][1:3] == ["8", "nf4"] and rows["qlora"][7:10] == ["1", "1", "2"]
    assert main(["plan", str(RECIPE), "--modes", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["modes"]["lora"]["total_nodes"] == 2 and data["modes"]["full"]["trainer_nodes"] >= 3
