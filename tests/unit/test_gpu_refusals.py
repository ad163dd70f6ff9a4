"""What NCCL, CUDA IPC and the GPU build refuse at run time, `recipe validate` and `train --dry-run`
refuse first, checked over every production recipe (gpu-readiness-audit-2 #6, #7, #8, #12):

- `nccl` with colocated servers: trainer rank 0 and the node-0 server's first worker share GPU 0
  in one NCCL group (NCCL: duplicate GPU);
- `ipc` beyond one trainer node (the other nodes' GPUs are invisible to rank 0) or without
  colocation;
- LoRA/QLoRA with `sleep_level: 2` (the wake refills only the adapted tensors);
- LoRA on experts over TE's grouped GEMM (no per-expert linears).

QLoRA on a GPU job is accepted (#8): the actor builds the QLoRA spec (`megatron/qlora_spec.py`),
whose local linears hold the NF4 base, with per-expert linears, TE's norms and flash attention.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.config.rules import lint

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = sorted(p for p in (REPO / "recipes").glob("qwen3_*/*.yaml") if p.name != "base.yaml")
IDS = [f"{p.parent.name}/{p.stem}" for p in PRODUCTION]


def errors(recipe: Path, *overrides: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in lint(load_recipe(recipe, list(overrides)), check_paths=False):
        if f.level == "error":
            out.setdefault(f.rule, []).append(f"{f.key}: {f.message}")
    return out


def test_every_production_recipe_is_listed() -> None:
    assert {p.parent.name + "/" + p.stem for p in PRODUCTION} == {
        f"qwen3_next_80b_a3b/{a}" for a in ("grpo", "gspo", "chord")} | {
        f"qwen3_235b_a22b/{a}" for a in ("grpo", "gspo", "chord", "gspo_qlora", "grpo_async")}


def test_async_rollout_is_refused_on_the_colocated_layouts() -> None:
    # The published Qwen3-Next recipes colocate their servers: generating while the trainer runs
    # would share its GPUs.
    for recipe in PRODUCTION:
        got = errors(recipe, "rollout.max_staleness=1").get("async-rollout", [])
        assert bool(got) == (load_recipe(recipe).rollout.placement == "colocated"), recipe
    assert errors(REPO / "recipes/qwen3_235b_a22b/grpo_async.yaml") == {}


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_nccl_is_refused_exactly_with_colocated_servers(recipe: Path) -> None:
    cfg = load_recipe(recipe)
    got = errors(recipe, "rollout.weight_transfer=nccl").get("weight-transfer", [])
    if cfg.rollout.placement == "colocated":
        (msg,) = got
        assert msg.startswith("rollout.weight_transfer: 'nccl' puts trainer rank 0") and "duplicate GPU" in msg
    else:
        assert got == []


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_ipc_is_refused_on_every_production_layout(recipe: Path) -> None:
    cfg = load_recipe(recipe)
    (msg,) = errors(recipe, "rollout.weight_transfer=ipc")["weight-transfer"]
    if cfg.rollout.placement == "colocated":
        assert f"all {cfg.parallelism.nodes} trainer nodes" in msg      # 8 nodes: 7 out of reach
    else:
        assert "needs placement 'colocated'" in msg


def test_ipc_on_one_colocated_node_is_allowed() -> None:
    recipe = REPO / "recipes/qwen3_next_80b_a3b/grpo.yaml"
    assert "weight-transfer" not in errors(recipe, "rollout.weight_transfer=ipc", "parallelism.nodes=1")


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_lora_with_sleep_level_2_is_refused(recipe: Path) -> None:
    lora = ("lora.rank=8", "lora.targets=[q,k,v,o]")
    (msg,) = errors(recipe, *lora, "rollout.sleep_level=2")["lora-sleep"]
    assert msg.startswith("rollout.sleep_level: 2 drops the servers' weights")
    assert "lora-sleep" not in errors(recipe, *lora, "rollout.sleep_level=1")
    assert "lora-sleep" not in errors(recipe, "lora.rank=0", "rollout.sleep_level=2")


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_qlora_is_accepted_on_gpu_jobs_under_the_qlora_spec(recipe: Path) -> None:
    qlora = () if recipe.stem == "gspo_qlora" else ("lora.rank=8", "lora.targets=[q,k,v,o]",
                                                     "lora.base_quantization=nf4")
    got = errors(recipe, *qlora)
    assert load_recipe(recipe, list(qlora)).gpus_per_node > 0          # a GPU job
    assert "lora-base-quantization" not in got, got
    if recipe.stem == "gspo_qlora":          # the published QLoRA run validates as it stands
        assert got == {}
    # As a CPU job (the tiny QLoRA runs) too.
    assert "lora-base-quantization" not in errors(recipe, *qlora, "slurm.gpus_per_node=0")
    # What has no code path is still refused by name, on GPU jobs as on CPU jobs.
    (msg,) = errors(recipe, *qlora, "lora.base_quantization=fp8")["lora-base-quantization"]
    assert "'fp8' has no code path" in msg


@pytest.mark.parametrize(("recipe", "override", "rule"), [
    ("qwen3_next_80b_a3b/grpo.yaml", "rollout.weight_transfer=nccl", "[weight-transfer]"),
    ("qwen3_next_80b_a3b/chord.yaml", "rollout.weight_transfer=ipc", "[weight-transfer]"),
    ("qwen3_235b_a22b/gspo_qlora.yaml", "rollout.sleep_level=2", "[lora-sleep]"),
    ("qwen3_235b_a22b/gspo_qlora.yaml", "lora.base_quantization=fp8", "[lora-base-quantization]"),
])
def test_dry_run_and_validate_refuse(capsys: pytest.CaptureFixture[str], recipe: str, override: str,
                                     rule: str) -> None:
    path = str(REPO / "recipes" / recipe)
    assert main(["train", "--dry-run", path, override, "--no-check-paths"]) == 1
    out = capsys.readouterr()
    assert rule in out.out + out.err and "preflight failed" in out.out
    assert main(["recipe", "validate", path, override, "--no-check-paths"]) != 0
    out = capsys.readouterr()
    assert rule in out.out + out.err


def test_dry_run_and_validate_accept_the_published_qlora_run(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(REPO / "recipes/qwen3_235b_a22b/gspo_qlora.yaml")
    assert main(["train", "--dry-run", path, "--no-check-paths"]) == 0
    out = capsys.readouterr()
    assert "preflight passed (0 errors" in out.out and "[lora-base-quantization]" not in out.out + out.err
    assert main(["recipe", "validate", path, "--no-check-paths"]) == 0
    assert "valid (0 errors" in capsys.readouterr().out


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_lora_on_experts_is_refused_on_gpu_jobs(recipe: Path) -> None:
    """Found with this audit: TE's grouped-GEMM experts have no per-expert linears for adapters."""
    experts = ("lora.rank=8", "lora.targets=[q,experts]", "parallelism.expert_tensor_parallel_size=1",
               "lora.base_quantization=none")
    got = errors(recipe, *experts).get("lora-targets", [])
    assert any("'experts' on a GPU job" in m for m in got), got
    assert not any("GPU job" in m for m in errors(recipe, *experts, "slurm.gpus_per_node=0").get("lora-targets", []))
    # Under QLoRA the spec runs the experts as per-expert local linears: adapters have modules to hook.
    qlora = errors(recipe, *experts[:-1], "lora.base_quantization=nf4")
    assert "lora-targets" not in qlora and "lora-base-quantization" not in qlora, qlora


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_the_server_start_timeout_covers_a_cold_start(recipe: Path) -> None:
    """Audit 3 #4: 600 s did not cover a cold 235B server (470 GB per rollout node, then compile and
    graph capture); every production recipe waits 2 × the estimate, and the dry run refuses less."""
    from megatron_rl.model_config import resolve_hf_config
    from megatron_rl.planner.params import count_params
    from megatron_rl.planner.timing import STARTUP_MARGIN, cold_start_seconds
    from megatron_rl.preflight import startup_findings

    cfg = load_recipe(recipe, [])
    cold = cold_start_seconds(count_params(resolve_hf_config(cfg.model)), cfg)
    assert cold > 300 and cfg.rollout.startup_timeout_s >= STARTUP_MARGIN * cold
    assert startup_findings(cfg) == []
    (short,) = startup_findings(load_recipe(recipe, ["rollout.startup_timeout_s=600"]))
    assert short.rule == "startup-timeout" and short.key == "rollout.startup_timeout_s" and "600 s" in short.message


def test_the_dry_run_refuses_a_server_timeout_shorter_than_a_cold_start(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(REPO / "recipes/qwen3_235b_a22b/grpo.yaml")
    assert main(["train", "--dry-run", path, "rollout.startup_timeout_s=600", "--no-check-paths"]) == 1
    out = capsys.readouterr()
    assert "[startup-timeout]" in out.err and "at least 1080" in out.err
