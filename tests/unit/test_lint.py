"""Every cross-field lint rule fires on the mistake it exists for, and stays quiet otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_recipe
from megatron_rl.config.rules import RULES, lint
from tests.helpers.chat_templates import HYBRID, INSTRUCT, THINKING_2507
from tests.helpers.rollout import unit_paths

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny"


def findings(recipe: str, *overrides: str, check_paths: bool = False) -> dict[str, list[str]]:
    cfg = load_recipe(TINY / recipe, list(overrides))
    out: dict[str, list[str]] = {}
    for f in lint(cfg, check_paths=check_paths):
        out.setdefault(f.rule, []).append(f"{f.level}|{f.key}|{f.message}")
    return out


@pytest.mark.parametrize("recipe", ["grpo.yaml", "gspo.yaml", "grpo_lora.yaml"])
def test_tiny_recipes_are_clean(recipe: str) -> None:
    # Their model and data paths point into .cache/demo, which `megatron-rl demo` builds.
    assert findings(recipe) == {}


def test_gspo_with_one_step_per_generation_is_a_warning_naming_article_000() -> None:
    # On-policy GSPO is legitimate (article 000's run was exactly that), but worth a word.
    (msg,) = findings("gspo.yaml", "algorithm.steps_per_generation=1")["gspo-never-clips"]
    assert msg.startswith("warning|algorithm.steps_per_generation|") and "never acts" in msg
    assert "article 000" in msg
    # The same mistake through CHORD's RL part.
    got = findings("chord.yaml", "algorithm.chord.rl_objective=gspo", "algorithm.clip_eps_low=3e-4",
                   "algorithm.clip_eps_high=4e-4")
    assert "gspo-never-clips" in got
    assert "gspo-never-clips" not in findings("grpo.yaml")


def test_sequence_ratio_with_large_eps_is_a_warning() -> None:
    (msg,) = findings("gspo.yaml", "algorithm.clip_eps_high=0.2")["sequence-ratio-eps"]
    assert msg.startswith("warning|") and "0.2" in msg
    assert "sequence-ratio-eps" not in findings("gspo.yaml")
    assert "sequence-ratio-eps" not in findings("grpo.yaml")   # token ratios use 0.2 legitimately


def test_kl_without_reference() -> None:
    (msg,) = findings("grpo.yaml", "algorithm.kl_beta=0.1", "model.reference=none")["kl-needs-reference"]
    assert msg.startswith("error|model.reference|")
    assert "kl-needs-reference" not in findings("grpo.yaml", "algorithm.kl_beta=0.1")
    (msg,) = findings("grpo.yaml", "model.reference=path")["kl-needs-reference"]
    assert "reference_path" in msg


def test_chord_expert_rows_must_split_over_dp() -> None:
    dp4 = ("parallelism.gpus_per_node=4", "trainer.global_batch_size=64")
    (msg,) = findings("chord.yaml", *dp4, "algorithm.chord.sft_batch_size=6")["chord-sft-split"]
    assert msg == ("error|algorithm.chord.sft_batch_size|6 expert rows per optimizer step do not split over "
                   "the 4 data-parallel ranks; use a multiple of 4")
    assert "chord-sft-split" not in findings("chord.yaml", *dp4, "algorithm.chord.sft_batch_size=4")
    assert "chord-sft-split" not in findings("grpo.yaml", *dp4, "algorithm.chord.sft_batch_size=6")


def test_rollout_server_must_fit_one_node() -> None:
    gpu_job = "slurm.gpus_per_node=null"                 # = parallelism.gpus_per_node (1 in the tiny recipes)
    rule = "rollout-server-fits-a-node"
    (msg,) = findings("grpo.yaml", gpu_job, "rollout.tensor_parallel_size=2")[rule]
    assert msg.startswith("error|rollout.data_parallel_size|")
    assert "rollout.tensor_parallel_size 2 × rollout.data_parallel_size 1 = 2 GPUs does not fit a node of 1" in msg
    assert rule not in findings("grpo.yaml", gpu_job, "rollout.tensor_parallel_size=2",
                                "parallelism.gpus_per_node=2", "trainer.global_batch_size=256")
    # A CPU job (slurm.gpus_per_node 0, as the tiny recipes set) has no GPUs to count.
    assert rule not in findings("grpo.yaml", "rollout.tensor_parallel_size=2")


def test_memory_options_megatron_core_cannot_build() -> None:
    got = findings("grpo.yaml", "parallelism.optimizer_cpu_offload=true", "parallelism.use_distributed_optimizer=false",
                   "parallelism.overlap_param_gather=true")["memory-options"]
    assert [m.split("|")[1] for m in got] == ["parallelism.optimizer_cpu_offload"] * 2 + \
        ["parallelism.overlap_param_gather"]
    assert "fp32" in got[1]                                   # the tiny recipes train in fp32
    (msg,) = findings("grpo.yaml", "parallelism.recompute_granularity=full", "parallelism.recompute_method=block",
                      "parallelism.recompute_num_layers=3")["memory-options"]
    assert "block recompute of 3 layers, but a pipeline stage has 2" in msg
    (msg,) = findings("grpo.yaml", "parallelism.gpus_per_node=2", "parallelism.pipeline_model_parallel_size=2",
                      "parallelism.moe_token_dispatcher_type=allgather")["memory-options"]
    assert msg.startswith("error|parallelism.moe_token_dispatcher_type|") and "use alltoall" in msg
    assert "memory-options" not in findings("grpo.yaml", "parallelism.recompute_granularity=full",
                                            "parallelism.overlap_grad_reduce=true",
                                            "parallelism.overlap_param_gather=true")


def test_evaluation_needs_eval_data() -> None:
    (msg,) = findings("grpo.yaml", "data.eval_path=null")["eval-needs-data"]
    assert msg == "error|data.eval_path|evaluation.interval is 10 but data.eval_path is not set"
    (msg,) = findings("grpo.yaml", "evaluation.interval=0")["eval-needs-data"]
    assert msg.startswith("warning|evaluation.interval|") and "never evaluated" in msg
    assert "eval-needs-data" not in findings("grpo.yaml", "evaluation.interval=0", "data.eval_path=null")


def test_chord_without_sft_data() -> None:
    (msg,) = findings("chord.yaml", "data.sft_path=null")["chord-needs-sft-data"]
    assert msg.startswith("error|data.sft_path|")
    assert "chord-needs-sft-data" not in findings("chord.yaml")


def test_parallel_sizes_must_divide_world_experts_and_heads() -> None:
    # world 2, TP 4
    got = findings("grpo.yaml", "parallelism.gpus_per_node=2", "parallelism.tensor_model_parallel_size=4",
                   "trainer.global_batch_size=32", "parallelism.sequence_parallel=true")["parallel-sizes"]
    assert any("world size" in m for m in got)
    assert any("num_attention_heads" not in m and "num_key_value_heads" in m for m in got)  # 2 kv heads
    # 4 experts, EP 3 (world 6)
    got = findings("grpo.yaml", "parallelism.gpus_per_node=6", "parallelism.expert_model_parallel_size=3",
                   "trainer.micro_batch_size=1", "trainer.global_batch_size=48")["parallel-sizes"]
    assert any("num_experts (4)" in m for m in got)
    # PP 3 on 2 layers
    got = findings("grpo.yaml", "parallelism.gpus_per_node=3", "parallelism.pipeline_model_parallel_size=3",
                   )["parallel-sizes"]
    assert any("num_hidden_layers (2)" in m for m in got)
    # MoE + TP needs sequence parallel
    got = findings("grpo.yaml", "parallelism.gpus_per_node=2", "parallelism.tensor_model_parallel_size=2")
    assert any("sequence_parallel" in m for m in got["parallel-sizes"])
    clean = findings("grpo.yaml", "parallelism.gpus_per_node=4", "parallelism.tensor_model_parallel_size=2",
                     "parallelism.expert_model_parallel_size=2", "parallelism.sequence_parallel=true")
    assert "parallel-sizes" not in clean


def test_batch_divisibility() -> None:
    # DP 4 × micro 8 = 32 does not divide 48
    (msg,) = findings("grpo.yaml", "parallelism.gpus_per_node=4", "trainer.global_batch_size=48",
                      "trainer.max_tokens_per_microbatch=null", "trainer.micro_batch_size=8")["batch-sizes"]
    assert "DP × micro_batch_size = 4 × 8" in msg
    # With a token budget any number of rows forms a micro-batch: only DP must divide.
    assert "batch-sizes" not in findings("grpo.yaml", "parallelism.gpus_per_node=4", "trainer.global_batch_size=48")
    got = findings("grpo.yaml", "parallelism.gpus_per_node=4", "trainer.global_batch_size=50")["batch-sizes"]
    assert any("DP × micro_batch_size = 4 × 1" in m for m in got)
    (msg,) = findings("grpo.yaml", "rollout.n=5")["batch-sizes"]
    assert msg.startswith("error|rollout.n|") and "= 128" in msg
    assert "batch-sizes" not in findings("grpo.yaml", "rollout.n=16")


def test_rollout_placement() -> None:
    assert "rollout-placement" in findings("grpo.yaml", "rollout.placement=disaggregated")
    assert "rollout-placement" in findings("grpo.yaml", "rollout.nodes=2")
    assert "rollout-placement" not in findings("grpo.yaml", "rollout.placement=disaggregated", "rollout.nodes=1")


def test_ipc_weight_transfer_needs_colocated_servers() -> None:
    assert "weight-transfer" in findings("grpo.yaml", "rollout.weight_transfer=ipc", "rollout.placement=disaggregated",
                                         "rollout.nodes=1")
    assert "weight-transfer" not in findings("grpo.yaml", "rollout.weight_transfer=ipc")
    assert "weight-transfer" not in findings("grpo.yaml", "rollout.weight_transfer=nccl",
                                             "rollout.placement=disaggregated", "rollout.nodes=1")


def test_a_rollout_server_must_fit_one_node() -> None:
    rule = "rollout-server-fits-a-node"
    gpu_job = "slurm.gpus_per_node=null"                 # = parallelism.gpus_per_node (1 in the tiny recipes)
    got = findings("grpo.yaml", gpu_job, "rollout.tensor_parallel_size=2")          # 2 GPUs, nodes of 1
    assert [m.split("|")[:2] for m in got[rule]] == [["error", "rollout.data_parallel_size"]]
    assert "2 GPUs does not fit a node of 1" in got[rule][0]
    spare = findings("grpo.yaml", gpu_job, "parallelism.gpus_per_node=2", "rollout.placement=disaggregated",
                     "rollout.nodes=1")
    assert [m.split("|")[0] for m in spare[rule]] == ["warning"]            # 1 of 2 GPUs idle
    assert rule not in findings("grpo.yaml", gpu_job, "parallelism.gpus_per_node=2")  # colocated: the rest trains


def test_sleeping_servers_of_their_own_nodes_is_a_warning() -> None:
    rule = "sleep-needs-colocation"
    (msg,) = findings("grpo.yaml", "rollout.placement=disaggregated", "rollout.nodes=1",
                      "rollout.sleep_level=1")[rule]
    assert msg.startswith("warning|rollout.sleep_level|1: the servers have nodes of their own")
    assert rule not in findings("grpo.yaml", "rollout.sleep_level=1")                  # colocated
    assert rule not in findings("grpo.yaml", "rollout.placement=disaggregated", "rollout.nodes=1")


def test_unknown_reward_name_lists_known_ones() -> None:
    (msg,) = findings("grpo.yaml", "rewards.weights={mcq_answr: 1.0}")["reward-names"]
    assert "rewards.weights.mcq_answr" in msg and "mcq_answer" in msg.split("allowed:")[1]


def test_missing_files_are_named_with_their_key(tmp_path: Path) -> None:
    # The recipe's other files exist (unit_paths); only the one named here is missing.
    got = findings("grpo.yaml", *unit_paths("grpo.yaml"), f"data.train_path={tmp_path}/absent.jsonl",
                   check_paths=True)
    (msg,) = got["missing-file"]
    assert msg == f"error|data.train_path|no such file or directory: {tmp_path}/absent.jsonl"
    got = findings("grpo.yaml", "model.tiny={}", f"model.hf_config={tmp_path}", check_paths=True)
    assert "config.json" in got["model-config"][0]


def test_every_rule_is_exercised_above() -> None:
    source = Path(__file__).read_text(encoding="utf-8")
    for name in RULES:
        assert f'"{name}"' in source, f"lint rule {name} has no test"


def test_token_budget_rules() -> None:
    assert "token-budget" not in findings("grpo.yaml")                     # tiny: budget 640 >= 80 tokens
    (msg,) = findings("grpo.yaml", "trainer.max_tokens_per_microbatch=50")["token-budget"]
    assert msg.startswith("warning|trainer.max_tokens_per_microbatch|") and "80" in msg
    (msg,) = findings("grpo.yaml", "trainer.micro_batch_size=4")["token-budget"]
    assert msg.startswith("warning|trainer.micro_batch_size|") and "not used" in msg
    assert "token-budget" not in findings("grpo.yaml", "trainer.max_tokens_per_microbatch=null",
                                          "trainer.micro_batch_size=4")
    (msg,) = findings("grpo.yaml", "parallelism.gpus_per_node=2", "parallelism.expert_model_parallel_size=2",
                      "parallelism.moe_token_dispatcher_type=allgather")["token-budget"]
    assert msg.startswith("error|parallelism.moe_token_dispatcher_type|") and "alltoall" in msg


def test_packed_sequences_are_refused_with_the_alternative() -> None:
    with pytest.raises(ConfigError) as err:
        load_recipe(REPO / "recipes" / "tiny" / "grpo.yaml", ["trainer.packed=true"])
    msg = str(err.value)
    assert "trainer.packed" in msg and "not supported yet" in msg and "max_tokens_per_microbatch" in msg
    assert "Gated DeltaNet" in msg


def test_routing_replay_needs_a_moe_model() -> None:
    assert "routing-replay" not in findings("grpo.yaml", "rollout.routing_replay=true",
                                            "rollout.routing_replay_diagnostics=true")
    (msg,) = findings("grpo.yaml", "rollout.routing_replay=true", "model.tiny.num_experts=0")["routing-replay"]
    assert msg.startswith("error|rollout.routing_replay|") and "MoE" in msg
    (msg,) = findings("grpo.yaml", "rollout.routing_replay_diagnostics=true")["routing-replay"]
    assert msg.startswith("error|rollout.routing_replay_diagnostics|")


def test_lora_targets() -> None:
    assert "lora-targets" not in findings("grpo.yaml", "lora.rank=8")
    got = findings("grpo.yaml", "lora.alpha=32")["lora-targets"]
    assert got[0].startswith("warning|lora.alpha|") and "rank is 0" in got[0]
    assert findings("grpo.yaml", "lora.rank=8", "lora.targets=[]")["lora-targets"][0].startswith("error|lora.targets|")
    got = findings("grpo.yaml", "lora.rank=8", "lora.targets=[q,gdn,experts]")["lora-targets"]
    assert any("'gdn'" in m and "no Gated DeltaNet" in m for m in got)        # tiny MoE: no GDN
    assert not any("'experts'" in m for m in got)                           # it has experts
    assert "lora-targets" not in findings("grpo.yaml", "lora.rank=8", "lora.targets=[q,v,experts]")
    got = findings("grpo.yaml", "lora.rank=8", "lora.targets=[experts]", "parallelism.gpus_per_node=2",
                   "parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true")["lora-targets"]
    assert got[0].startswith("error|parallelism.expert_tensor_parallel_size|")


def test_quantized_base_needs_a_rank_and_a_code_path() -> None:
    rule = "lora-base-quantization"
    (msg,) = findings("grpo.yaml", "lora.base_quantization=nf4")[rule]
    assert msg.startswith("error|lora.base_quantization|") and "set lora.rank > 0" in msg
    (msg,) = findings("grpo.yaml", "lora.rank=8", "lora.base_quantization=fp8")[rule]
    assert msg.startswith("error|lora.base_quantization|") and "'fp8' has no code path" in msg
    assert rule not in findings("grpo.yaml", "lora.rank=8", "lora.base_quantization=nf4")
    assert rule not in findings("grpo.yaml")


def test_qlora_and_expert_adapters_on_a_gpu_job() -> None:
    """A GPU job builds QLoRA from its spec (local linears, per-expert MLPs): accepted; LoRA on the
    experts of the bf16 base stays refused there (TE's grouped GEMM has no per-expert linears)."""
    gpu_job = ("slurm.gpus_per_node=null", "lora.rank=8")     # = parallelism.gpus_per_node (1)
    assert findings("grpo.yaml", *gpu_job, "lora.base_quantization=nf4") == {}
    assert findings("grpo.yaml", *gpu_job, "lora.base_quantization=nf4", "lora.targets=[q,experts]") == {}
    (msg,) = findings("grpo.yaml", *gpu_job, "lora.targets=[q,experts]")["lora-targets"]
    assert msg.startswith("error|lora.targets|'experts' on a GPU job") and "base_quantization: nf4" in msg
    assert "lora-targets" not in findings("grpo.yaml", "lora.rank=8", "lora.targets=[q,experts]")   # CPU job


def test_unreadable_hf_config_skips_the_expert_check_and_says_why(tmp_path: Path) -> None:
    """N8: without the model's config, 'experts' on a GPU job is not refused as if the model had
    experts: the check is skipped with a warning naming the file and why (a dense model would be
    refused by the target check instead, a MoE one by the grouped-GEMM check)."""
    gpu_job = ("slurm.gpus_per_node=null", "lora.rank=8", "lora.targets=[q,experts]", "model.tiny={}")
    missing = tmp_path / "absent"
    for check_paths in (False, True):            # cluster paths (not checked), or checked
        got = findings("grpo.yaml", *gpu_job, f"model.hf_config={missing}", check_paths=check_paths)
        (msg,) = got["lora-targets"]
        assert msg == (f"warning|model.hf_config|'experts' on a GPU job not checked: the model's HF config "
                       f"cannot be read (model config not found: {missing})"), check_paths
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    got = findings("grpo.yaml", *gpu_job, f"model.hf_config={bad}")
    assert got["model-config"] and got["lora-targets"] == [
        f"warning|model.hf_config|'experts' on a GPU job not checked: the model's HF config cannot be read "
        f"({bad}/config.json:1: invalid JSON: Expecting property name enclosed in double quotes)"]
    # A readable config: MoE refused on a GPU job (test above), dense refused as having no experts.
    dense = tmp_path / "dense"
    dense.mkdir()
    moe = json.loads((REPO / "recipes/models/qwen3_30b_a3b/config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**moe, "num_experts": 0}))
    (msg,) = findings("grpo.yaml", *gpu_job, f"model.hf_config={dense}")["lora-targets"]
    assert msg.startswith("error|lora.targets|target 'experts': the model") and "has no experts" in msg


def test_lora_with_sleep_level_2_is_refused() -> None:
    (msg,) = findings("grpo.yaml", "lora.rank=8", "rollout.sleep_level=2")["lora-sleep"]
    assert msg.startswith("error|rollout.sleep_level|2 drops the servers' weights")
    assert "lora-sleep" not in findings("grpo.yaml", "lora.rank=8", "rollout.sleep_level=1")
    assert "lora-sleep" not in findings("grpo.yaml", "rollout.sleep_level=2")          # a full sync refills all


def test_gpu_weight_transfers_that_nccl_or_ipc_refuse() -> None:
    (msg,) = findings("grpo.yaml", "rollout.weight_transfer=nccl")["weight-transfer"]     # colocated
    assert "duplicate GPU" in msg
    (msg,) = findings("grpo.yaml", "rollout.weight_transfer=ipc", "parallelism.nodes=2",
                      "trainer.global_batch_size=256")["weight-transfer"]
    assert "all 2 trainer nodes" in msg


def _tokenizer_dir(path: Path, template: str) -> Path:
    path.mkdir(parents=True)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}), encoding="utf-8")
    return path




def test_thinking_template_with_a_short_budget_is_a_warning(tmp_path: Path) -> None:
    rule = "thinking-budget"
    hybrid = _tokenizer_dir(tmp_path / "Qwen3-8B", HYBRID)
    (msg,) = findings("grpo.yaml", f"model.tokenizer={hybrid}", "rollout.max_response_length=512")[rule]
    assert msg.startswith("warning|rollout.max_response_length|512 tokens") and "model opens <think>" in msg
    assert rule not in findings("grpo.yaml", f"model.tokenizer={hybrid}", "rollout.max_response_length=512",
                                "rollout.chat_template_kwargs={enable_thinking: false}")
    assert rule not in findings("grpo.yaml", f"model.tokenizer={hybrid}", "rollout.max_response_length=1024")
    thinking = _tokenizer_dir(tmp_path / "t", THINKING_2507)
    (msg,) = findings("grpo.yaml", f"model.tokenizer={thinking}", "rollout.max_response_length=512")[rule]
    assert "the prompt opens <think>" in msg and "judged by its chat template" in msg
    instruct = _tokenizer_dir(tmp_path / "i", INSTRUCT)
    assert rule not in findings("grpo.yaml", f"model.tokenizer={instruct}", "rollout.max_response_length=512")
    assert rule not in findings("grpo.yaml")                            # the demo tokenizer: no thinking


def test_thinking_is_judged_by_the_release_name_when_the_tokenizer_is_on_the_cluster() -> None:
    rule = "thinking-budget"
    q235 = REPO / "recipes" / "qwen3_235b_a22b"
    for recipe in ("grpo.yaml", "gspo.yaml", "chord.yaml"):      # Instruct-2507, 512 tokens: no warning
        cfg = load_recipe(q235 / recipe)
        assert cfg.rollout.max_response_length == 512 and "Instruct-2507" in str(cfg.model.init_checkpoint)
        assert rule not in {f.rule for f in lint(cfg, check_paths=False)}, recipe
    hybrid = [f"model.{key}=/cluster/models/Qwen3-235B-A22B" for key in ("init_checkpoint", "tokenizer")]
    got = [f for f in lint(load_recipe(q235 / "grpo.yaml", hybrid), check_paths=False) if f.rule == rule]
    assert [f.level for f in got] == ["warning"] and "judged by its name" in got[0].message
    off = load_recipe(q235 / "grpo.yaml", [*hybrid, "rollout.chat_template_kwargs={enable_thinking: false}"])
    assert rule not in {f.rule for f in lint(off, check_paths=False)}
    # Article 000's Thinking-2507 run has room to finish its thinking (2000 tokens).
    qlora = load_recipe(q235 / "gspo_qlora.yaml")
    assert rule not in {f.rule for f in lint(qlora, check_paths=False)}
    assert rule in {f.rule for f in lint(load_recipe(q235 / "gspo_qlora.yaml", ["rollout.max_response_length=512"]),
                                        check_paths=False)}


def test_async_rollout_needs_servers_of_their_own_and_a_correction() -> None:
    disaggregated = ("rollout.placement=disaggregated", "rollout.nodes=1")
    (msg,) = findings("grpo.yaml", "rollout.max_staleness=1")["async-rollout"]
    assert msg.startswith("error|rollout.max_staleness|1 makes the servers generate") and "'colocated'" in msg
    (msg,) = findings("grpo.yaml", "rollout.max_staleness=1", *disaggregated, "rollout.sleep_level=0")["async-rollout"]
    assert msg.startswith("error|rollout.sleep_level|0: a sleeping server")
    # The default ('auto') corrects stale samples; only a written 'none' runs without, warned.
    assert "async-rollout" not in findings("grpo.yaml", "rollout.max_staleness=1", *disaggregated)
    (msg,) = findings("grpo.yaml", "rollout.max_staleness=1", *disaggregated,
                      "algorithm.correction.mode=none")["async-rollout"]
    assert msg.startswith("warning|algorithm.correction.mode|'none'")
    assert "async-rollout" not in findings("grpo.yaml", "rollout.max_staleness=1", *disaggregated,
                                           "algorithm.correction.mode=tis_token")
    assert "async-rollout" not in findings("grpo.yaml", "rollout.sleep_level=0")     # synchronous: no rule


def test_sync_delta_on_is_refused_where_every_version_goes_whole() -> None:
    assert "sync-delta" not in findings("grpo.yaml", "rollout.sync_delta=on")       # tiny: shm, one node
    (msg,) = findings("grpo.yaml", "rollout.sync_delta=on", "rollout.sleep_level=2")["sync-delta"]
    assert msg.startswith("error|rollout.sync_delta|") and "level-2 sleep" in msg and "'auto'" in msg
    assert "sync-delta" not in findings("grpo.yaml", "rollout.sync_delta=auto", "rollout.sleep_level=2")


def test_a_correction_at_raw_log_probs_is_a_warning() -> None:
    raw = ("algorithm.correction.mode=tis_token", "rollout.logprobs_mode=raw", "rollout.temperature=0.9")
    (msg,) = findings("grpo.yaml", *raw)["correction-at-raw-logprobs"]
    assert msg.startswith("warning|rollout.logprobs_mode|") and "T = 0.9" in msg and "processed" in msg
    assert "correction-at-raw-logprobs" not in findings("grpo.yaml", *raw[:2], "rollout.temperature=1.0")
    assert "correction-at-raw-logprobs" not in findings("grpo.yaml", raw[0], "rollout.logprobs_mode=processed")
    assert "correction-at-raw-logprobs" not in findings("grpo.yaml", *raw[1:])      # no correction
