"""The walkthrough of `recipes/qwen3_next_80b_a3b/README.md` ("Reproducing article 001, step by
step") runs as written: every command of its marked block, in order, through bash, with the site
variables pointing at stand-ins — the tiny model for the released checkpoint, the synthetic IgakuQA
fixture, the test expert texts, the tiny recipe and a one-node Slurm of our own (the `slurm`
fixture of test_sbatch.py; skipped where Slurm is not installed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.rollout import REPO, demo_assets
from tests.helpers.slurm import CPU_JOB, _free_port_pair, job_info

README = REPO / "recipes" / "qwen3_next_80b_a3b" / "README.md"
FIXTURES = REPO / "tests" / "fixtures"
SPECIALIST_FIXTURE = FIXTURES / "specialist"


def walkthrough_commands(text: str, marker: str = "walkthrough") -> list[str]:
    """The commands of the block after `<!-- {marker} -->` (comments and blank lines dropped)."""
    block = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)```\n<!-- /{marker} -->", text, re.DOTALL)
    assert block, f"README.md lost its <!-- {marker} --> block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def site_variables(text: str) -> list[str]:
    """The names the README's site block exports (the test must set each of them)."""
    site = re.search(r"```bash\n(export HF=.*?)```", text, re.DOTALL)
    assert site, "README.md lost its site block"
    return re.findall(r"(?:export |\s)([A-Z_]+)=", site.group(1))


def test_the_walkthrough_names_every_step() -> None:
    text = README.read_text(encoding="utf-8")
    commands = walkthrough_commands(text)
    verbs = [c.split()[1:3] for c in commands if c.startswith("megatron-rl ")]
    assert verbs == [["convert", "hf-to-mcore"], ["data", "prepare"], ["data", "prepare"], ["train", "--dry-run"],
                     ["sbatch", '"$RECIPE"'], ["eval", "generate"], ["eval", "generate"], ["eval", "igakuqa"],
                     ["eval", "table"]]
    assert sorted(site_variables(text)) == ["DATA", "EXPERT_TEXTS", "HF", "IGAKUQA", "MCORE", "RECIPE", "RUNS", "SITE"]


def _env(tmp: Path, slurm_env: dict[str, str]) -> dict[str, str]:
    """The README's site variables, bound to stand-ins; `megatron-rl` on PATH."""
    hf = tmp / "Qwen3-Next-80B-A3B-Instruct"
    shutil.copytree(demo_assets()["model"], hf)            # the tiny (warmed-up) model with its tokenizer
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "megatron-rl").write_text(f'#!/bin/bash\nexec "{sys.executable}" -m megatron_rl.cli "$@"\n')
    (bin_dir / "megatron-rl").chmod(0o755)
    site = [*CPU_JOB, f"slurm.master_port={_free_port_pair()}", "trainer.max_steps=2",
            "rollout.max_prompt_length=400", "evaluation.interval=0"]
    return dict(slurm_env, PATH=f"{bin_dir}:{slurm_env['PATH']}", PYTHONPATH=str(REPO), HF=str(hf),
                MCORE=str(tmp / "mcore"), IGAKUQA=str(FIXTURES / "igakuqa"),
                EXPERT_TEXTS=str(FIXTURES / "chord_sft" / "expert_texts.jsonl"), DATA=str(tmp / "data"),
                RUNS=str(tmp / "runs"), RECIPE="recipes/tiny/grpo.yaml", SITE=" ".join(site))


def _wait_for_job(env: dict[str, str], job: str, timeout: float = 900) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(env, job)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return info
        time.sleep(2)
    pytest.fail(f"job {job} did not finish in {timeout:.0f} s")


def test_the_walkthrough_runs_as_written(slurm: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    env = _env(tmp_path, slurm)
    outputs: list[str] = []
    for command in walkthrough_commands(README.read_text(encoding="utf-8")):
        # `export` lines carry over to the next commands, as in the user's shell.
        if command.startswith("export "):
            name = command.removeprefix("export ").split("=", 1)[0]
            env[name] = subprocess.run(["bash", "-c", f'{command}\nprintf "%s" "${name}"'], env=env,
                                       capture_output=True, text=True, check=True).stdout
            continue
        proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
        submitted = re.search(r"Submitted batch job (\d+)", proc.stdout)
        if submitted:                   # the user waits for the job here (squeue / tail)
            info = _wait_for_job(env, submitted.group(1))
            run = Path(env["RUNS"]) / env["NAME"]
            log = "".join(p.read_text()[-3000:] for p in (run / "slurm").glob("*.out"))
            assert info["JobState"] == "COMPLETED", log
    run = Path(env["RUNS"]) / env["NAME"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == [1, 2]
    recipe = (run / "recipe.resolved.yaml").read_text()
    assert str(Path(env["MCORE"])) in recipe and "igakuqa_train.jsonl" in recipe
    for name in (env["NAME"], "base"):
        lines = (Path(env["RUNS"]) / "eval" / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) == 6                                   # the fixture's 2022 questions
        meta = json.loads((Path(env["RUNS"]) / "eval" / f"{name}.jsonl.meta.json").read_text())
        assert meta["recipe"] == "recipes/tiny/grpo.yaml" and meta["decoding"]["temperature"] == 0.0
    assert "Format" in outputs[-2] or "format" in outputs[-2]    # eval igakuqa's report
    report = Path(env["RUNS"]) / "eval" / "report"
    assert (report / "table.md").is_file() and "grpo" in (report / "table.md").read_text()
    assert os.path.isfile(Path(env["DATA"]) / "chord_sft.jsonl")


def _megatron_rl_on_path(tmp: Path) -> str:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "megatron-rl").write_text(f'#!/bin/bash\nexec "{sys.executable}" -m megatron_rl.cli "$@"\n')
    (bin_dir / "megatron-rl").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_the_walkthrough_ends_with_the_article_s_two_four_system_tables(tmp_path: Path) -> None:
    """The README's `walkthrough-tables` block (and the specialist section's `data prepare`), run as
    written on the answers the three runs and the base would have left in $RUNS/eval: the IgakuQA
    fixture's recorded answers (alpha, beta, gamma) and one all-correct system, and the specialist
    fixture's four systems. The training and `eval generate` steps are the other test's."""
    text = README.read_text(encoding="utf-8")
    runs, data = tmp_path / "runs", tmp_path / "data"
    (runs / "eval").mkdir(parents=True)
    env = dict(os.environ, PATH=_megatron_rl_on_path(tmp_path), PYTHONPATH=str(REPO), RUNS=str(runs),
               DATA=str(data), IGAKUQA=str(FIXTURES / "igakuqa"), SPECIALIST=str(SPECIALIST_FIXTURE / "exam.jsonl"))
    recorded = FIXTURES / "igakuqa" / "baseline_results" / "2022"
    for name, source in (("base", "alpha"), ("article001-grpo", "beta"), ("article001-gspo", "gamma")):
        shutil.copy(recorded / f"116-A_{source}.jsonl", runs / "eval" / f"{name}.jsonl")
    gold = [json.loads(line) for line in (FIXTURES / "igakuqa/data/2022/116-A.jsonl").read_text().splitlines()]
    (runs / "eval" / "article001-chord.jsonl").write_text("".join(
        json.dumps({"problem_id": q["problem_id"], "prediction": ",".join(q["answer"])}) + "\n" for q in gold))
    for system in ("base", "grpo", "gspo", "chord"):
        target = "specialist_base" if system == "base" else f"specialist_article001-{system}"
        shutil.copy(SPECIALIST_FIXTURE / "pred" / f"{system}.jsonl", runs / "eval" / f"{target}.jsonl")
    specialist_section = text[text.index("### The specialist exam"):]
    prepare = [line for line in specialist_section.splitlines() if "data prepare specialist" in line]
    commands = walkthrough_commands(text, "walkthrough-tables")
    assert len(prepare) == 1 and [c.split()[1:3] for c in commands] == [["eval", "table"], ["eval", "specialist"]]
    for command in (*prepare, *commands):
        proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    igakuqa = json.loads((runs / "eval" / "igakuqa" / "table.json").read_text(encoding="utf-8"))
    assert igakuqa["systems"] == ["base", "grpo", "gspo", "chord"] and igakuqa["baseline"] == "base"
    cells = {row["system"]: row["cells"]["All"] for row in igakuqa["rows"]}
    # Counted by hand from the fixture: alpha 4/6, beta 5/6, gamma 4/6 correct; chord answers every
    # question right, so it is right on base's 2 misses (c 2) and wrong on none of base's hits (b 0).
    assert {s: (c["n"], c["correct"]) for s, c in cells.items()} == {
        "base": (6, 4), "grpo": (6, 5), "gspo": (6, 4), "chord": (6, 6)}
    assert (cells["chord"]["b"], cells["chord"]["c"], cells["chord"]["p_value"]) == (0, 2, 0.5)
    assert "| chord | 100.0% (+33.3) |" in (runs / "eval" / "igakuqa" / "table.md").read_text(encoding="utf-8")

    specialist = json.loads((runs / "eval" / "specialist" / "table.json").read_text(encoding="utf-8"))
    rows = {row["system"]: row["cells"]["All"] for row in specialist["rows"]}
    assert {s: c["correct"] for s, c in rows.items()} == {"base": 22, "grpo": 31, "gspo": 32, "chord": 23}
    assert specialist["best_counts"] == {"grpo": 2, "gspo": 1, "chord": 1}   # the fixture README's counts
    markdown = (runs / "eval" / "specialist" / "table.md").read_text(encoding="utf-8")
    assert "| grpo | 70.5% (+20.5*) | 74.2% (+22.6*) |" in markdown and "grpo 2, gspo 1, chord 1" in markdown

