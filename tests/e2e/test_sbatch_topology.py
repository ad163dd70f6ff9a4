"""Multi-node rendering: the script of each production recipe, run against stand-ins for a 12-node
allocation (srun, scontrol, nvidia-smi, Python), starts what `megatron-rl plan` counts — trainer
nodes × ranks per node = the layout's world size, one rollout server per rollout node with TP × DP
GPUs of that node — so a topology mistake shows here and not on a cluster."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.config import load_recipe
from megatron_rl.config.rules import lint
from megatron_rl.slurm import job_files, render_script
from megatron_rl.slurm.render import job_recipe, total_nodes
from tests.helpers.rollout import REPO
from tests.mp.common import free_port

PRODUCTION = sorted(p for p in (REPO / "recipes").glob("qwen3_*/*.yaml") if p.name != "base.yaml")

# srun: logs its options and the node list, then runs the command once per node with that node's
# SLURMD_NODENAME (a rollout step then stays up, as servers do, until the script stops it).
FAKE_SRUN = r'''#!/bin/bash
opts=()
while [[ "${1:-}" == -* ]]; do opts+=("$1"); shift; done
nodelist=$FAKE_NODES
for o in "${opts[@]}"; do [[ "$o" == --nodelist=* ]] && nodelist=${o#--nodelist=}; done
"$FAKE_PY" -c 'import json, sys; open(sys.argv[1], "a").write(json.dumps({"srun": sys.argv[2:]}) + "\n")' \
    "$STUB_LOG" "${opts[@]}" -- "$@"
IFS=, read -ra nodes <<< "$nodelist"
for node in "${nodes[@]}"; do SLURMD_NODENAME=$node "$@" || exit $?; done
[[ "$*" == *rollout-server* ]] && exec sleep 60
exit 0
'''
FAKE_SCONTROL = '#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && tr , "\\n" <<< "$FAKE_NODES"\n'
FAKE_SMI = '#!/bin/bash\nfor i in $(seq 0 $((FAKE_GPUS - 1))); do echo "GPU $i: stand-in (UUID: GPU-$i)"; done\n'
# The job's Python: logs each call; a rollout server writes the address file the script waits for.
STUB_PY = """
import json, os, sys
open(os.environ["STUB_LOG"], "a").write(json.dumps({"node": os.environ.get("SLURMD_NODENAME"), "argv": sys.argv[1:],
                                                    "omp": os.environ.get("OMP_NUM_THREADS")}) + "\\n")
if "rollout-server" in sys.argv:
    run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
    os.makedirs(os.path.join(run_dir, "rollout"), exist_ok=True)
    open(os.path.join(run_dir, "rollout", "server.json"), "w").write("{}")
"""


def plan_json(recipe: Path) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli_main(["plan", str(recipe), "--json"])
    assert rc == 0, f"{recipe}: the recipe's layout does not fit (megatron-rl plan exit {rc})"
    return json.loads(out.getvalue())


def run_job(recipe: Path, tmp: Path) -> tuple[list[dict], list[dict], object]:
    """Render `recipe` for its full allocation and run the script against the stand-ins."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("nvidia-smi", FAKE_SMI),
                       ("python-stub", f"#!{sys.executable}\n{STUB_PY}")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    cfg = load_recipe(recipe, [f"logging.output_dir={tmp / 'runs'}", "container.runtime=none",
                               f"container.python={bin_dir / 'python-stub'}", f"slurm.master_port={free_port()}"])
    files = job_files(cfg, cwd=tmp)
    script = tmp / "job.sbatch"
    script.write_text(render_script(job_recipe(cfg, files), files))
    nodes = [f"n{i:02d}" for i in range(1, total_nodes(cfg) + 1)]
    log = tmp / "calls.jsonl"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[x]",
               SLURM_CPUS_ON_NODE="112", FAKE_NODES=",".join(nodes), FAKE_GPUS=str(cfg.parallelism.gpus_per_node),
               FAKE_PY=sys.executable, STUB_LOG=str(log))
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [c["srun"][:c["srun"].index("--")] + ["::"] + c["srun"][c["srun"].index("--") + 1:]
             for c in calls if "srun" in c]
    return steps, [c for c in calls if "argv" in c], cfg


def option(words: list[str], name: str) -> str:
    """`name=value` among srun's own options (before '::'), or in a command line."""
    words = words[:words.index("::")] if "::" in words else words
    values = [w.split("=", 1)[1] for w in words if w.startswith(name + "=")]
    assert len(values) == 1, (name, words)
    return values[0]


@pytest.mark.parametrize("recipe", PRODUCTION, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_rendered_steps_start_what_the_plan_counts(recipe: Path, tmp_path: Path) -> None:
    plan = plan_json(recipe)
    steps, python_calls, cfg = run_job(recipe, tmp_path)
    gpus_per_node = plan["hardware"]["gpus_per_node"]
    layout = dict(re.findall(r"\b(TP|PP|CP|DP)(\d+)\b", plan["layout"]))
    world = int(layout["TP"]) * int(layout["PP"]) * int(layout["CP"]) * int(layout["DP"])
    nodes = [f"n{i:02d}" for i in range(1, total_nodes(cfg) + 1)]
    rollout = plan["rollout"]

    train_step = next(s for s in steps if "megatron_rl.launch" in s)
    train_nodes = int(option(train_step, "--nodes"))
    assert option(train_step, "--ntasks-per-node") == "1"
    assert option(train_step, "--gpus-per-node") == str(gpus_per_node)
    assert option(train_step, "--nodelist") == ",".join(nodes[:train_nodes])
    torchrun = [c for c in python_calls if c["argv"][:2] == ["-m", "megatron_rl.launch"]]
    assert [c["node"] for c in torchrun] == nodes[:train_nodes]            # one launcher per trainer node
    assert int(option(torchrun[0]["argv"], "--nnodes")) == train_nodes
    procs = int(option(torchrun[0]["argv"], "--nproc-per-node"))
    assert train_nodes * procs == world
    assert option(torchrun[0]["argv"], "--numa-binding") == "node"
    # 112 CPUs per node: the ranks share what a colocated server (API + engine cores + workers) leaves.
    server_cpus = 1 + rollout["dp"] + rollout["tp"] * rollout["dp"] if rollout["placement"] == "colocated" else 0
    assert {c["omp"] for c in torchrun} == {str((112 - server_cpus) // procs)}
    assert option(train_step, "--cpus-per-task") == "112"

    servers = [c for c in python_calls if "rollout-server" in c["argv"]]
    if rollout["placement"] == "disaggregated":
        rollout_step = next(s for s in steps if any("rollout-server" in w for w in s))
        assert option(rollout_step, "--ntasks-per-node") == "1"
        assert option(rollout_step, "--nodelist") == ",".join(nodes[train_nodes:])
        step_gpus = int(option(rollout_step, "--gpus-per-node"))
        assert option(rollout_step, "--cpus-per-task") == "112"
        # One server per rollout node, each on TP × DP GPUs of its node: the plan's servers and GPUs.
        assert sorted(c["node"] for c in servers) == nodes[train_nodes:]
        assert len(servers) == rollout["servers"] and len(servers) * step_gpus == rollout["gpus"]
        assert rollout["tp"] * rollout["dp"] == step_gpus
        assert {tuple(train_args(c)[1:]) for c in torchrun} == {("--resume",)}     # the servers' hosts come from them
    else:
        # Colocated: each trainer node's first rank starts that node's server (train/fleet.py),
        # listening on the node's name so that rank 0 reaches it: the plan's servers, TP × DP GPUs each.
        assert servers == [] and rollout["servers"] == train_nodes
        assert rollout["tp"] * rollout["dp"] == gpus_per_node and rollout["gpus"] == train_nodes * gpus_per_node
        assert [(c["node"], train_args(c)[1:]) for c in torchrun] == \
            [(n, [f"rollout.host={n}", "--resume"]) for n in nodes[:train_nodes]]
    assert train_nodes + (len(servers) if servers else 0) == len(nodes)


def train_args(call: dict) -> list[str]:
    """What `megatron-rl train` gets on one node: the recipe, then overrides and flags."""
    argv = call["argv"]
    return argv[argv.index("train") + 1:]


def test_a_server_spanning_nodes_is_a_lint_error_and_a_plan_mismatch(tmp_path: Path) -> None:
    """The 235B layout before it was fixed: one TP 4 × DP 8 server for 4 nodes of 8 GPUs."""
    recipe = REPO / "recipes" / "qwen3_235b_a22b" / "grpo.yaml"
    cfg = load_recipe(recipe, ["rollout.data_parallel_size=8"])
    errors = [f for f in lint(cfg, check_paths=False) if f.rule == "rollout-server-fits-a-node"]
    assert [(f.level, f.key) for f in errors] == [("error", "rollout.data_parallel_size")]
    assert "32 GPUs does not fit a node of 8" in errors[0].message
    half = load_recipe(recipe, ["rollout.data_parallel_size=1"])
    warnings = [f for f in lint(half, check_paths=False) if f.rule == "rollout-server-fits-a-node"]
    assert [f.level for f in warnings] == ["warning"] and "4 of its 8 GPUs stay idle" in warnings[0].message
    out = io.StringIO()
    with redirect_stdout(out):
        cli_main(["plan", str(recipe), "rollout.data_parallel_size=8", "--json"])
    rollout = json.loads(out.getvalue())["rollout"]
    assert (rollout["servers"], rollout["fits"]) == (0, False)          # the plan refuses it too
    assert "32 GPUs does not fit a node of 8" in rollout["problem"]


def test_colocated_plan_counts_one_server_per_trainer_node() -> None:
    """A server smaller than a node: still one per node (the rest of the node's GPUs only train)."""
    recipe = REPO / "recipes" / "qwen3_next_80b_a3b" / "grpo.yaml"
    out = io.StringIO()
    with redirect_stdout(out):
        cli_main(["plan", str(recipe), "rollout.data_parallel_size=2", "--json"])
    rollout = json.loads(out.getvalue())["rollout"]
    assert (rollout["servers"], rollout["tp"], rollout["dp"], rollout["gpus"]) == (8, 2, 2, 32)
