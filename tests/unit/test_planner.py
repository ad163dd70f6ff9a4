"""Planner: exact parameter counts, the memory model, the layout search, `megatron-rl plan`, and the
production recipes (recipes/qwen3_*/{grpo,gspo,chord}.yaml).

Expected values are computed here by hand from the model dimensions (or counted on real
transformers models), never copied from the planner's output.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.config.rules import lint
from megatron_rl.config.schema import (
    RecipeConfig,
)
from megatron_rl.fused_head import default_chunk_rows
from megatron_rl.planner import PlannerError, count_params
from megatron_rl.planner.memory import GB, Hardware, describe, microbatch_tokens, stage_layer_ranges, stage_memory
from megatron_rl.planner.plan import SAFE_MARGIN_PCT, estimate, layout_problems, plan
from tests.helpers.recipes import hand_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
PRODUCTION = sorted(p for p in RECIPES.glob("qwen3_*/[gc]*.yaml") if p.stem in ("grpo", "gspo", "chord"))
# (gspo_qlora.yaml, the published QLoRA run, is checked in tests/unit/test_planner_lora.py.)
Q235 = json.loads((RECIPES / "models/qwen3_235b_a22b/config.json").read_text())
QNEXT = json.loads((RECIPES / "models/qwen3_next_80b_a3b/config.json").read_text())


def test_production_recipe_set_is_complete() -> None:
    names = {f"{p.parent.name}/{p.name}" for p in PRODUCTION}
    assert names == {f"{m}/{a}.yaml" for m in ("qwen3_235b_a22b", "qwen3_next_80b_a3b")
                     for a in ("grpo", "gspo", "chord")}


# ------------------------------------------------------------------ counts vs real models
TINY_DENSE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=96,
                  hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, attention_bias=True, tie_word_embeddings=False)
TINY_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=96,
                hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[2],
                tie_word_embeddings=False)
TINY_NEXT = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=96,
                 hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                 shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                 num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1],
                 full_attention_interval=2, tie_word_embeddings=False)


def _real_model(hf: dict[str, Any]) -> Any:
    import transformers

    arch = hf["architectures"][0]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return getattr(transformers, arch)(config_cls(**hf))


def _numel(model: Any, *fragments: str) -> int:
    return sum(p.numel() for n, p in model.named_parameters()
               if not fragments or any(f in n for f in fragments))


@pytest.mark.parametrize("hf", [TINY_DENSE, dict(TINY_DENSE, tie_word_embeddings=True,
                                                 attention_bias=False), TINY_MOE, TINY_NEXT],
                         ids=["dense", "dense-tied", "moe", "next"])
def test_total_matches_the_real_model(hf: dict[str, Any]) -> None:
    assert count_params(hf).total == _numel(_real_model(hf))


def test_components_match_the_real_model() -> None:
    model, got = _real_model(TINY_NEXT), count_params(TINY_NEXT).breakdown()
    assert got["attention"]["total"] == _numel(model, "self_attn.")
    assert got["linear_attention"]["total"] == _numel(model, "linear_attn.")
    assert got["moe_experts"]["total"] == _numel(model, "mlp.experts.")
    assert got["shared_experts"]["total"] == _numel(model, "mlp.shared_expert")  # incl. its gate
    assert got["router"]["total"] == _numel(model, "mlp.gate.weight")
    assert got["dense_mlp"]["total"] == _numel(model, "layers.1.mlp.")           # mlp_only_layers
    assert got["embedding"]["total"] == _numel(model, "embed_tokens")
    assert got["output"]["total"] == _numel(model, "lm_head")
    assert got["norms"]["total"] == _numel(model, "layernorm", "model.norm.")


@pytest.mark.parametrize("hf,moe_layers", [(TINY_MOE, 3), (TINY_NEXT, 3)], ids=["moe", "next"])
def test_active_params_by_hand(hf: dict[str, Any], moe_layers: int) -> None:
    # Every parameter is used per token except the routed experts not chosen: (E - k) of them
    # in each MoE layer, each 3 · h · f_e (gate, up, down projections).
    idle = moe_layers * (hf["num_experts"] - hf["num_experts_per_tok"]) * 3 * 32 * 16
    got = count_params(hf)
    assert got.active == _numel(_real_model(hf)) - idle
    assert got.architecture == hf["architectures"][0]


def test_transformers_5_expert_key_is_read() -> None:
    # transformers 5 serialises Qwen3MoeConfig(num_experts=E) as num_local_experts E and
    # num_experts None; the count must not fall back to a dense model (or fail on the None).
    from transformers import Qwen3MoeConfig

    written = Qwen3MoeConfig(**{k: v for k, v in TINY_MOE.items()
                                if k not in ("architectures", "model_type")}).to_dict()
    hf = dict(written, architectures=TINY_MOE["architectures"])
    assert count_params(hf).total == count_params(TINY_MOE).total == _numel(_real_model(TINY_MOE))
    assert count_params(hf).active == count_params(TINY_MOE).active
    t5 = dict(TINY_MOE, num_experts=None, num_local_experts=TINY_MOE["num_experts"])
    assert count_params(t5).total == count_params(TINY_MOE).total


def test_mtp_is_counted_only_when_declared() -> None:
    # fc over [embedding; hidden] (2h·h), two pre-fc norms and a final norm (3h), plus one
    # full-attention MoE decoder layer: the real model's layer 3 (full attention, MoE, 2 norms).
    h = 32
    layer3 = sum(p.numel() for p in _real_model(TINY_NEXT).model.layers[3].parameters())
    plain = count_params(TINY_NEXT)
    with_mtp = count_params(dict(TINY_NEXT, num_nextn_predict_layers=1))
    assert with_mtp.total - plain.total == 2 * h * h + 3 * h + layer3
    assert with_mtp.component("mtp") == with_mtp.total - plain.total
    assert plain.component("mtp") == 0


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(PlannerError, match="LlamaForCausalLM"):
        count_params({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


# ------------------------------------------------------------------ counts vs published numbers
def _within(got: float, published: float, rel: float) -> bool:
    return abs(got - published) <= rel * published


def test_qwen3_235b_matches_its_model_card() -> None:
    # huggingface.co/Qwen/Qwen3-235B-A22B: "235B in total and 22B activated",
    # "Number of Paramaters (Non-Embedding): 234B". Counted with Qwen's convention (embedding and
    # output included in "activated"; see test_qwen3_30b_a3b_matches_its_model_card).
    p = count_params(Q235)
    assert _within(p.total, 235e9, 0.01)
    assert _within(p.non_embedding, 234e9, 0.01)
    assert _within(p.active, 22e9, 0.02)


def test_qwen3_next_80b_matches_its_model_card() -> None:
    # huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct: "80B in total and 3B activated",
    # "Number of Paramaters (Non-Embedding): 79B". The "3B" is the A3B of the name: it matches the
    # non-embedding active weights (3.25B) to the card's one digit, hence 10% here; with embedding and
    # output (the convention the other Qwen3 cards use) the count is 3.87B.
    p = count_params(QNEXT)
    assert _within(p.total, 80e9, 0.01)
    assert _within(p.non_embedding, 79e9, 0.01)
    assert _within(p.active - p.embedding_params, 3e9, 0.10)


def test_qwen3_30b_a3b_matches_its_model_card() -> None:
    # Config: huggingface.co/Qwen/Qwen3-30B-A3B/config.json. Card: "30.5B in total and 3.3B
    # activated", "Non-Embedding: 29.9B" — three digits, which pins the "activated" convention.
    hf = dict(Q235, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
              num_attention_heads=32, num_hidden_layers=48)
    p = count_params(hf)
    assert _within(p.total, 30.5e9, 0.005)
    assert _within(p.non_embedding, 29.9e9, 0.005)
    assert _within(p.active, 3.3e9, 0.02)


def test_qwen3_dense_matches_its_model_cards() -> None:
    # huggingface.co/Qwen/Qwen3-8B: 8.2B, non-embedding 6.95B; Qwen/Qwen3-4B (tied): 4.0B, 3.6B.
    q8b = dict(architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
               num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               vocab_size=151936, tie_word_embeddings=False)
    q4b = dict(q8b, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
    assert _within(count_params(q8b).total, 8.2e9, 0.01)
    assert _within(count_params(q8b).non_embedding, 6.95e9, 0.005)
    assert _within(count_params(q4b).total, 4.0e9, 0.01)
    assert _within(count_params(q4b).non_embedding, 3.6e9, 0.01)




def _terms(cfg: RecipeConfig, stage: int, vllm_gb: float = 0.0) -> dict[str, Any]:
    """The memory terms of one pipeline stage, by key."""
    memory = stage_memory(count_params(dict(cfg.model.tiny)), cfg, stage, vllm_gb)
    return {t.key: t for t in memory.terms}


HAND_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64,
                intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                num_experts_per_tok=2, tie_word_embeddings=False)
HAND = hand_recipe(HAND_MOE, model={"params_dtype": "bf16", "reference": "init"},
               parallelism=dict(nodes=1, gpus_per_node=8, tensor_model_parallel_size=2,
                                pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                                expert_tensor_parallel_size=1, sequence_parallel=True,
                                recompute_granularity="full", recompute_num_layers=1),
               rollout=dict(max_prompt_length=64, max_response_length=64, gpu_memory_utilization=0.25),
               trainer=dict(global_batch_size=32, micro_batch_size=2),
               algorithm=dict(kl_beta=0.1))          # a KL term: the run has a reference model


def test_hand_case_is_a_valid_layout() -> None:
    assert layout_problems(HAND, HAND_MOE) == ()


def test_memory_terms_by_hand_first_stage() -> None:
    h, V, E, k, fe, a, g, d = 64, 512, 4, 2, 32, 4, 2, 16
    tp, ep, world = 2, 2, 8
    # Per layer on one GPU: attention projections split over TP; q/k norms, router, norms whole;
    # experts split over EP (ETP 1). Stage 0 = layers 0, 1 + the vocab-parallel embedding.
    attn = (h * (a * d + 2 * g * d) + a * d * h) // tp
    dense = 2 * (attn + 2 * d + E * h + 2 * h) + V * h // tp
    expert = 2 * (E * 3 * h * fe) // ep
    n = dense + expert
    # Distributed optimizer: dense over world/(TP·PP) = 2 ranks, experts over world/(PP·EP·ETP) = 2.
    optimizer = 12 * (dense / (world // 4) + expert / (world // 4))
    # Activations: DP = 8/(2·2) = 2, 32/(2·2) = 8 micro-batches, 2 in flight on stage 0. Full
    # recompute keeps each layer's input (bf16, SP-split) per micro-batch: 2 · (2·128) · h/2 bytes.
    tokens = 2 * 128
    checkpoint = 2 * tokens * h / tp
    # One layer rematerialized for the backward pass: norms 4h/2, attention
    # [(a+g)d + (a+2g)d + ad]/2, router probs 2E/2 per token; per local token (tokens/2) k routed
    # copies of (2h + 3f_e).
    one_layer = (2 * tokens * (4 * h / 2 + ((a + g) * d + (a + 2 * g) * d + a * d) / 2 + 2 * E / 2)
                 + 2 * (tokens / 2) * k * (2 * h + 3 * fe))
    terms = {key: t.gb for key, t in _terms(HAND, 0, 0.25 * 80).items()}
    assert terms["weights"] == pytest.approx(2 * n / GB)
    assert terms["gradients"] == pytest.approx(4 * n / GB)
    assert terms["optimizer"] == pytest.approx(optimizer / GB)
    assert terms["activations"] == pytest.approx((2 * 2 * checkpoint + one_layer) / GB)
    assert terms["logits"] == 0
    assert terms["reference"] == pytest.approx(2 * n / GB)
    assert terms["vllm"] == pytest.approx(20.0)


def test_memory_terms_by_hand_last_stage_and_offload() -> None:
    h, V, tp = 64, 512, 2
    cfg = hand_recipe(HAND_MOE, model={"reference": "none"},
                  parallelism=dict(HAND.parallelism.__dict__, optimizer_cpu_offload=True),
                  rollout=dict(max_prompt_length=64, max_response_length=64,
                               placement="disaggregated", nodes=1),
                  trainer=dict(global_batch_size=32, micro_batch_size=2, fused_lm_head=False))
    terms = _terms(cfg, 1)
    # Last stage: bf16 logits + fp32 log-softmax over the vocab shard, one micro-batch in flight.
    assert terms["logits"].gb == pytest.approx(6 * (2 * 128) * V / tp / GB)
    assert terms["optimizer"].gb == 0 and "host memory" in terms["optimizer"].note
    assert terms["reference"].gb == 0 and terms["vllm"].gb == 0
    # The output layer and final norm sit on the last stage instead of the embedding.
    assert terms["weights"].gb - _terms(cfg, 0)["weights"].gb == pytest.approx(2 * h / GB)


def test_logits_term_follows_the_fused_heads_chunk_and_shows_te_without_it() -> None:
    """Qwen3's vocabulary at TP 2 and 4,608-token micro-batches (the article's): the fused head holds
    one chunk of rows (10 bytes per logit: a bf16 chunk, two fp32 temporaries) whatever the length;
    the logits path holds 6 bytes per logit of the whole micro-batch, and TE's kernel 4 more."""
    vocab, tp = 151_936, 2
    fields = dict(HAND_MOE, vocab_size=vocab)

    def terms(tokens: int, fused: bool) -> dict[str, Any]:
        cfg = hand_recipe(fields, model={"params_dtype": "bf16", "reference": "none"},
                          parallelism=dict(HAND.parallelism.__dict__, pipeline_model_parallel_size=1),
                          rollout=dict(max_prompt_length=64, max_response_length=tokens - 64,
                                       placement="disaggregated", nodes=1),
                          trainer=dict(global_batch_size=32, micro_batch_size=1, fused_lm_head=fused))
        return _terms(cfg, 0)

    rows = default_chunk_rows(vocab // tp)
    assert rows == 441                                   # 128 MiB of fp32 [rows, 75,968]
    for tokens in (4608, 32768):
        fused, unfused = terms(tokens, True), terms(tokens, False)
        assert fused["logits"].gb == pytest.approx(10 * rows * vocab / tp / GB)
        assert fused["te_buffer"].gb == 0 and "chunk" in fused["logits"].note
        assert unfused["logits"].gb == pytest.approx(6 * tokens * vocab / tp / GB)
        assert unfused["te_buffer"].gb == pytest.approx(4 * tokens * vocab / tp / GB)
        assert "TE" in unfused["te_buffer"].note
    # Audit 3, finding 14: 0.7 GB bf16 logits + 1.4 GB fp32 tempered + 1.4 GB fp32 gradient.
    assert terms(4608, False)["logits"].gb + terms(4608, False)["te_buffer"].gb == pytest.approx(3.5, abs=0.01)
    assert terms(32768, True)["logits"].gb == pytest.approx(0.335, abs=0.001)


def test_recompute_modes_order_activations() -> None:
    acts = {}
    for mode in ("none", "selective", "full"):
        cfg = hand_recipe(HAND_MOE, parallelism=dict(HAND.parallelism.__dict__, recompute_granularity=mode),
                      rollout=HAND.rollout.__dict__, trainer=HAND.trainer.__dict__)
        acts[mode] = _terms(cfg, 0)["activations"].gb
    # With flash attention there is no s² score tensor for 'selective' to drop.
    assert acts["full"] < acts["selective"] == acts["none"]


def test_rollout_kv_budget_by_hand() -> None:
    # Qwen3-Next, vLLM TP2 DP4 with EP over 8 GPUs, 0.5 × 80 GB: 12 full-attention layers cache
    # K and V (2 KV heads → 1 per GPU, head_dim 256); 36 Gated DeltaNet layers keep a conv state
    # ((2·16·128 + 32·128)/2 channels × 3) and a recurrent state (32/2 heads × 128 × 128), bf16.
    cfg = hand_recipe(QNEXT, rollout=dict(tensor_parallel_size=2, data_parallel_size=4,
                                      enable_expert_parallel=True, gpu_memory_utilization=0.5,
                                      max_prompt_length=1024, max_response_length=3072))
    r = estimate(cfg, count_params(QNEXT), Hardware(8, 80.0)).rollout
    p = count_params(QNEXT)
    experts = p.component("moe_experts")
    assert r.weights_gb == pytest.approx(2 * ((p.total - experts) / 2 + experts / 8) / GB)
    per_seq = 4096 * 12 * 2 * 1 * 256 * 2 + 36 * (8192 / 2 * 3 + 16 * 128 * 128) * 2
    assert r.sequence_gb == pytest.approx(per_seq / GB)
    assert r.sequences_per_server == pytest.approx(4 * (40 - r.weights_gb - 3.0) / (per_seq / GB))


# ------------------------------------------------------------------ published layouts
def test_published_64_gpu_qwen3_235b_layout_fits() -> None:
    # THUDM/slime scripts/run-qwen3-235B-A22B.sh (8 × 8 H100/H800 80 GB for the actor): TP 4 with
    # sequence parallelism, PP 4, CP 2, EP 16, ETP 1, full recompute (uniform, 1 layer), CPU Adam
    # (--optimizer-cpu-offload), fp32 grad accumulation, --max-tokens-per-gpu 16384 (= one
    # 32768-token micro-batch over CP 2), global batch 64, no KL (no reference model); the SGLang
    # rollout runs on 64 further GPUs, one TP 8 engine per node (--rollout-num-gpus-per-engine 8;
    # modelled here as 8 disaggregated vLLM servers of TP 8, one per node, as the job starts them).
    cfg = hand_recipe(Q235, model={"reference": "none"},
                  parallelism=dict(nodes=8, tensor_model_parallel_size=4, sequence_parallel=True,
                                   pipeline_model_parallel_size=4, context_parallel_size=2,
                                   expert_model_parallel_size=16, expert_tensor_parallel_size=1,
                                   recompute_granularity="full", recompute_method="uniform",
                                   recompute_num_layers=1, optimizer_cpu_offload=True),
                  rollout=dict(placement="disaggregated", nodes=8, tensor_parallel_size=8,
                               data_parallel_size=1, enable_expert_parallel=True,
                               gpu_memory_utilization=0.9, max_prompt_length=1024,
                               max_response_length=31744),
                  trainer=dict(global_batch_size=64, micro_batch_size=1),
                  algorithm=dict(name="gspo", steps_per_generation=2))
    est = estimate(cfg, count_params(Q235), Hardware(8, 80.0))
    assert est.fits, est.stage.terms
    # 94 layers over 4 stages: the first holds 24 like slime's (which puts 22 on the last stage).
    assert [len(r) for r in stage_layer_ranges(94, 4)] == [24, 24, 23, 23]


def test_qwen3_235b_without_model_parallelism_does_not_fit_on_8_gpus() -> None:
    cfg = hand_recipe(Q235, parallelism=dict(nodes=1), trainer=dict(global_batch_size=64))
    result = plan(cfg, Q235, Hardware(8, 80.0))
    assert not result.estimate.fits and result.estimate.margin_gb < 0
    # bf16 weights alone are 470 GB; fp32 grads 940 GB: no layout of one node can hold it.
    assert result.estimate.stage.largest.key == "gradients"
    assert result.suggestions == ()


# ------------------------------------------------------------------ production recipes
@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_production_recipe_validates(path: Path) -> None:
    errors = [f for f in lint(load_recipe(path), check_paths=False) if f.level == "error"]
    assert errors == []


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_production_recipe_carries_the_published_setup(path: Path) -> None:
    cfg = load_recipe(path)
    a = cfg.algorithm
    assert (cfg.trainer.lr, a.kl_beta, cfg.model.reference) == (1e-6, 0.1, "init")
    assert (cfg.trainer.global_batch_size, cfg.rollout.n, cfg.rollout.temperature) == (512, 16, 0.9)
    # ms-swift reads "max_length 4096" as the prompt cap; completions at its default 512.
    assert (cfg.rollout.max_prompt_length, cfg.rollout.max_response_length) == (4096, 512)
    assert (cfg.trainer.epochs, cfg.rewards.weights) == (5, {"mcq_answer": 1.5, "japanese_only": 1.0})
    expected = {"grpo": (0.2, 0.2, 5), "chord": (0.2, 0.2, 5), "gspo": (3e-4, 4e-4, 3)}[path.stem]
    assert (a.name, a.clip_eps_low, a.clip_eps_high, a.steps_per_generation) == (path.stem, *expected)
    if a.name == "chord":
        c = a.chord
        assert (c.mu_peak, c.mu_valley, c.mu_decay_steps, c.phi) == (0.1, 0.01, 500, False)
        assert c.mu_warmup_steps == 0
    # Where the article is silent, ms-swift 3.11's Megatron GRPO defaults (recipes/base comments).
    assert (cfg.rollout.top_p, cfg.rollout.top_k, a.loss_agg_mode) == (0.9, 50,
                                                                       "seq-mean-token-mean")
    t = cfg.trainer
    assert (t.lr_decay_style, t.min_lr, t.lr_warmup_ratio) == ("cosine", 0.0, 0.0)
    assert (t.weight_decay, t.adam_beta1, t.adam_beta2, t.adam_eps, t.clip_grad) == (
        0.1, 0.9, 0.95, 1e-8, 1.0)


def test_production_node_counts() -> None:
    def nodes(name: str) -> tuple[int, int]:
        cfg = load_recipe(RECIPES / name)
        return cfg.parallelism.nodes, cfg.rollout.nodes

    assert nodes("qwen3_next_80b_a3b/grpo.yaml") == nodes("qwen3_next_80b_a3b/chord.yaml") == (8, 0)
    assert sum(nodes("qwen3_next_80b_a3b/gspo.yaml")) == 12


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_cli_plan_json_on_production_recipe(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", str(path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] and out["rollout"]["fits"]
    assert out["margin_pct"] >= SAFE_MARGIN_PCT
    assert out["total_gb"] == pytest.approx(sum(out["terms_gb"].values()), abs=0.01)
    # The recipe's layout is the search's first choice (README.md explains each).
    best = out["suggestions"][0]
    assert best["layout"] == out["layout"]


def test_cli_plan_table_and_node_override(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(RECIPES / "qwen3_235b_a22b/grpo.yaml")
    rc = main(["plan", recipe, "parallelism.expert_model_parallel_size=4", "--nodes", "1"])
    out = capsys.readouterr().out
    assert rc == 2 and "verdict: DOES NOT FIT" in out and "1 nodes × 8 GPUs" in out
    # EP 32 cannot live on one node (EP × ETP must divide 8 / PP): the linter's rule says so.
    assert main(["plan", recipe, "--nodes", "1"]) == 2
    assert "INVALID LAYOUT" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["plan", "no/such/recipe.yaml"], "recipe file not found"),
    (["plan", str(RECIPES / "tiny/grpo.yaml"), "model.tiny.architectures=[GPT2LMHeadModel]",
      "model.tiny.model_type=gpt2"], "unsupported architecture"),
    (["plan", str(RECIPES / "tiny/grpo.yaml"), "--gpu-memory-gb", "0"], "--gpu-memory-gb"),
])
def test_cli_plan_bad_input_is_one_line(argv: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_plan_tiny_recipe_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(RECIPES / "tiny/grpo.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["architecture"] == "Qwen3MoeForCausalLM"


def test_token_budget_sizes_activations_and_logits_by_the_budget() -> None:
    # Budget 160 tokens vs the padded 2 rows × 128: activations and logits scale by 160/256, and
    # a budget below one max-length sample still leaves room for that sample (128 tokens).
    budget = hand_recipe(HAND_MOE, model={"params_dtype": "bf16", "reference": "init"},
                     parallelism=HAND.parallelism.__dict__,
                     rollout=dict(max_prompt_length=64, max_response_length=64, gpu_memory_utilization=0.25),
                     trainer=dict(global_batch_size=32, max_tokens_per_microbatch=160))
    padded, got = _terms(HAND, 1, 20.0), _terms(budget, 1, 20.0)
    assert got["logits"].gb == pytest.approx(padded["logits"].gb * 160 / 256)
    # Full recompute: every term of the activations is linear in the micro-batch's tokens.
    assert got["activations"].gb == pytest.approx(padded["activations"].gb * 160 / 256)
    assert "token budget 160" in describe(budget) and microbatch_tokens(budget) == 160
    small = dataclasses.replace(budget, trainer=dataclasses.replace(budget.trainer, max_tokens_per_microbatch=100))
    assert microbatch_tokens(small) == 128
