"""`megatron-rl train --dry-run`: production recipes pass; a broken one is named exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.cli import main
from tests.helpers.rollout import REPO, unit_assets, unit_paths

PRODUCTION = [f"recipes/{model}/{algo}.yaml" for model in ("qwen3_next_80b_a3b", "qwen3_235b_a22b")
              for algo in ("grpo", "gspo", "chord")]


def dry_run(capsys: pytest.CaptureFixture[str], recipe: str, *args: str) -> tuple[int, str]:
    code = main(["train", "--dry-run", str(REPO / recipe), *args])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("recipe", PRODUCTION)
def test_production_recipes_pass(capsys: pytest.CaptureFixture[str], recipe: str) -> None:
    code, text = dry_run(capsys, recipe, "--no-check-paths")
    assert code == 0, text
    assert "preflight passed (0 errors" in text


@pytest.mark.parametrize("recipe", ["recipes/tiny/grpo.yaml", "recipes/tiny/gspo.yaml", "recipes/tiny/chord.yaml"])
def test_tiny_recipes_pass_with_their_files(capsys: pytest.CaptureFixture[str], recipe: str) -> None:
    code, text = dry_run(capsys, recipe, *unit_paths(recipe))
    assert code == 0, text


@pytest.mark.parametrize(("recipe", "overrides", "expected"), [
    # The CHORD layout before its fix: 8 expert rows over 16 DP ranks.
    ("recipes/qwen3_next_80b_a3b/chord.yaml", ["algorithm.chord.sft_batch_size=8"],
     "[chord-sft-split] algorithm.chord.sft_batch_size: 8 expert rows per optimizer step do not split over "
     "the 16 data-parallel ranks; use a multiple of 16"),
    # The 235B rollout before its fix: one server over 32 GPUs.
    ("recipes/qwen3_235b_a22b/grpo.yaml", ["rollout.data_parallel_size=8"],
     "[rollout-server-fits-a-node] rollout.data_parallel_size: one vLLM server of rollout.tensor_parallel_size 4 "
     "× rollout.data_parallel_size 8 = 32 GPUs does not fit a node of 8 GPUs"),
    ("recipes/qwen3_235b_a22b/grpo.yaml", ["parallelism.optimizer_cpu_offload=false"],
     "[fit] parallelism: DOES NOT FIT: margin"),
    ("recipes/qwen3_235b_a22b/grpo.yaml", ["trainer.global_batch_size=500"],
     "[batch-sizes] trainer.global_batch_size: 500 is not divisible by DP × micro_batch_size = 32 × 1"),
    ("recipes/qwen3_235b_a22b/grpo.yaml", ["parallelism.use_distributed_optimizer=false"],
     "[memory-options] parallelism.optimizer_cpu_offload: megatron-core offloads the distributed optimizer's"),
])
def test_a_broken_recipe_is_named(capsys: pytest.CaptureFixture[str], recipe: str, overrides: list[str],
                                  expected: str) -> None:
    code, text = dry_run(capsys, recipe, *overrides, "--no-check-paths")
    assert code == 1
    assert expected in text, text
    assert "preflight failed" in text


def test_prompts_longer_than_the_limit_are_found(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = dry_run(capsys, "recipes/tiny/grpo.yaml", *unit_paths("grpo.yaml"), "rollout.max_prompt_length=12")
    assert code == 1
    assert "[data] data.train_path: 0 of 2000 prompts fit rollout.max_prompt_length=12 tokens" in text


def test_some_long_prompts_are_a_warning(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    lines = (unit_assets()["train"]).read_text().splitlines()[:40]
    rows = [json.loads(line) for line in lines]
    for row in rows[:5]:                    # 5 of 40 prompts grow past the limit
        row["messages"][0]["content"] += " Think step by step before you answer." * 3
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, text = dry_run(capsys, "recipes/tiny/grpo.yaml", *unit_paths("grpo.yaml"), f"data.train_path={path}")
    assert code == 0, text
    assert "warning: [data] data.train_path: 5 of 40 prompts are longer than rollout.max_prompt_length=64" in text
    code, text = dry_run(capsys, "recipes/tiny/grpo.yaml", *unit_paths("grpo.yaml"), f"data.train_path={path}",
                         "trainer.global_batch_size=288")
    assert code == 1 and "35 of 40 prompts fit rollout.max_prompt_length=64 tokens" in text and "needs 36" in text


def test_missing_data_is_named_unless_paths_are_skipped(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    code, text = dry_run(capsys, "recipes/tiny/grpo.yaml", f"data.train_path={missing}")
    assert code == 1 and f"data.train_path: no such file or directory: {missing}" in text
    assert main(["train", "recipes/tiny/grpo.yaml", "--no-check-paths"]) == 1      # training needs files
    assert "only applies to --dry-run" in capsys.readouterr().err


def test_recipe_validate_does_not_import_torch() -> None:
    code = ("import sys; from megatron_rl.cli import main; "
            "rc = main(['recipe', 'validate', 'recipes/qwen3_next_80b_a3b/chord.yaml', '--no-check-paths']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
