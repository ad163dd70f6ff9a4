"""`megatron-rl sbatch`: every recipe renders to a script that bash and shellcheck accept; recipe
values stay literal; the script's logic runs in a sandbox with stand-ins for srun/scontrol; and on
a real one-node Slurm (tests/slurm/start_slurm.sh) the tiny recipe trains, survives scancel +
resubmission, and a SIGUSR1 before the time limit checkpoints, requeues and resumes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.config import load_recipe
from megatron_rl.slurm import SbatchError, job_files, render_script, sbatch_problems
from megatron_rl.slurm.render import job_recipe, parse_time_limit
from tests.helpers.rollout import REPO

PRODUCTION = sorted((REPO / "recipes").glob("qwen3_*/*.yaml"))

TINY = sorted((REPO / "recipes" / "tiny").glob("*.yaml"))

TINY_GRPO = REPO / "recipes" / "tiny" / "grpo.yaml"

def render(recipe: Path, tmp: Path, *overrides: str) -> tuple[str, object]:
    cfg = load_recipe(recipe, [f"logging.output_dir={tmp}", *overrides])
    files = job_files(cfg, cwd=tmp)
    return render_script(job_recipe(cfg, files), files), files

def shellcheck(path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (tools/install_ci_system_deps.sh installs it)")
    proc = subprocess.run(["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

def bash_n(path: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

# ------------------------------------------------------------------------------------ rendering
@pytest.mark.parametrize("recipe", PRODUCTION + TINY, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_recipe_renders_to_a_script_bash_and_shellcheck_accept(recipe: Path, tmp_path: Path) -> None:
    text, files = render(recipe, tmp_path)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    bash_n(script)
    shellcheck(script)
    cfg = load_recipe(recipe)
    lines = [line for line in text.splitlines() if line.startswith("#SBATCH ")]
    rollout_nodes = cfg.rollout.nodes if cfg.rollout.placement == "disaggregated" else 0
    assert f"#SBATCH --nodes={cfg.parallelism.nodes + rollout_nodes}" in lines
    assert f"#SBATCH --signal=B:USR1@{cfg.slurm.signal_before_s}" in lines
    assert "#SBATCH --requeue" in lines and "#SBATCH --open-mode=append" in lines
    assert "--rdzv-endpoint=\"$HEAD_NODE:$MASTER_PORT\"" in text and "--resume" in text
    if cfg.container.runtime == "none":
        assert "CONTAINER=()" in text
    else:
        assert f"CONTAINER=({cfg.container.runtime} exec --nv {cfg.container.image})" in text

def test_production_layout_requests_trainer_plus_rollout_nodes_and_gpus(tmp_path: Path) -> None:
    recipe = REPO / "recipes" / "qwen3_235b_a22b" / "grpo.yaml"
    text, _ = render(recipe, tmp_path, "slurm.partition=gpu", "slurm.account=med", "slurm.env.NCCL_IB_HCA=mlx5",
                     "slurm.extra_sbatch=[--constraint=h100]")
    for line in ("--nodes=12", "--gpus-per-node=8", "--partition=gpu", "--account=med", "--exclusive", "--mem=0",
                 "--time=24:00:00", "--ntasks-per-node=1", "--constraint=h100"):
        assert f"#SBATCH {line}" in text.splitlines(), line
    assert not any(line.startswith("#SBATCH --cpus-per-task") for line in text.splitlines())   # the whole node
    assert "NUMA_BINDING=node " in text and "SERVER_CPUS=0 " in text
    assert "TRAIN_NODES=8 " in text and "ROLLOUT_NODES=4 " in text and "PROCS_PER_NODE=8 " in text
    assert "export NCCL_IB_HCA=mlx5" in text
    assert "megatron_rl.cli rollout-server" in text           # the disaggregated servers' step

def test_site_overrides_of_the_resource_lines(tmp_path: Path) -> None:
    recipe = REPO / "recipes" / "qwen3_next_80b_a3b" / "grpo.yaml"
    text, _ = render(recipe, tmp_path, "slurm.exclusive=false", "slurm.cpus_per_task=64", "slurm.mem=900G",
                     "slurm.numa_binding=none")
    lines = text.splitlines()
    assert "#SBATCH --cpus-per-task=64" in lines and "#SBATCH --mem=900G" in lines
    assert "#SBATCH --exclusive" not in lines and "NUMA_BINDING=none " in text
    # Colocated: 1 API server + 4 engine cores + 8 workers (TP 2 × DP 4) of the trainer's node's CPUs.
    assert "SERVER_CPUS=13 " in text
    text, _ = render(recipe, tmp_path, "slurm.mem=null")
    assert not any(line.startswith("#SBATCH --mem") for line in text.splitlines())

def test_resolved_recipe_beside_the_script_pins_the_run_dir(tmp_path: Path) -> None:
    rc = cli_main(["sbatch", str(TINY_GRPO), f"logging.output_dir={tmp_path / 'runs'}", "logging.run_name=r1",
                   "--no-check-paths", "-o", str(tmp_path / "jobs" / "train.sbatch")])
    assert rc == 0
    script, recipe = tmp_path / "jobs" / "train.sbatch", tmp_path / "jobs" / "train.recipe.yaml"
    assert os.access(script, os.X_OK)
    resolved = load_recipe(recipe)
    assert resolved.logging.output_dir == str(tmp_path / "runs") and resolved.logging.run_name == "r1"
    assert resolved == job_recipe(load_recipe(TINY_GRPO, [f"logging.output_dir={tmp_path / 'runs'}",
                                                        "logging.run_name=r1"]), job_files(resolved))
    assert (tmp_path / "runs" / "r1" / "slurm").is_dir()      # Slurm opens the log there before the job runs
    assert f"RECIPE={recipe}" in script.read_text()

def test_flags_are_shorthands_for_recipe_keys(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = cli_main(["sbatch", str(TINY_GRPO), f"logging.output_dir={tmp_path}", "--no-check-paths", "-o", "-",
                   "--nodes", "2", "--time", "02:00:00", "--partition", "p", "--qos", "high", "--job-name", "j"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    for line in ("--nodes=2", "--time=02:00:00", "--partition=p", "--qos=high",
                 "--job-name=j"):
        assert f"#SBATCH {line}" in lines

@pytest.mark.parametrize("override,key", [
    ("container.runtime=apptainer", "container.image"),
    ("slurm.env={'BAD-NAME': x}", "slurm.env"),
    ("slurm.time_limit=tomorrow", "slurm.time_limit"),
    ("slurm.time_limit='00:04:00'", "slurm.signal_before_s"),
    ("slurm.extra_sbatch=[exclusive]", "slurm.extra_sbatch[0]"),
    ('slurm.job_name="a\\nb"', "slurm.job_name"),
    ("slurm.mem=lots", "slurm.mem"),
    ("slurm.exclusive=false", "slurm.cpus_per_task"),
])
def test_unrenderable_recipes_fail_naming_the_key(override: str, key: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    cfg = load_recipe(TINY_GRPO, [override])
    problems = sbatch_problems(cfg)
    assert problems and problems[0].startswith(key + ":"), problems
    with pytest.raises(SbatchError):
        render_script(cfg, job_files(cfg, cwd=tmp_path))
    assert cli_main(["sbatch", str(TINY_GRPO), override, f"logging.output_dir={tmp_path}", "--no-check-paths"]) == 1
    assert key in capsys.readouterr().err

def test_time_limits_in_every_slurm_format() -> None:
    cases = {"30": 1800, "30:15": 1815, "2:00:00": 7200, "1-0": 86400, "1-2:30": 95400, "1-00:00:10": 86410,
             "UNLIMITED": None}
    assert {k: parse_time_limit(k) for k in cases} == cases
    for bad in ("", "1:2:3:4", "x", "1-", "-5"):
        with pytest.raises(ValueError):
            parse_time_limit(bad)

# ------------------------------------------------------------------------------------ sandbox
# Run in its own directory: an executed `touch pwned` would leave the file there.
PAYLOAD = "$(touch pwned) `touch pwned` ${HOME} 'quote\" ; touch pwned"

def sandbox(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """Stand-ins for srun (runs the command here), scontrol and a stub Python that logs its calls."""
    bin_dir = tmp_path / "fake bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "${1:-}" == -* ]]; do shift; done\n'
                                  'SLURMD_NODENAME=$(hostname) exec "$@"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[[ "$1" == show ]] && hostname\n'
                                      'echo "scontrol $*" >> "$STUB_LOG.scontrol"\n')
    stub = bin_dir / "py stub"
    stub.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "open(os.environ['STUB_LOG'], 'a').write(json.dumps({'argv': sys.argv[1:], "
                    "'weird': os.environ.get('WEIRD')}) + '\\n')\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42",
               SLURM_JOB_NODELIST="n1", STUB_LOG=str(tmp_path / "stub.log"))
    return env, stub

def test_values_with_spaces_and_command_substitutions_stay_literal(tmp_path: Path) -> None:
    marker, payload = tmp_path / "pwned", PAYLOAD
    env, stub = sandbox(tmp_path)
    overrides = [f"logging.run_name={json.dumps('run ' + payload)}", f"slurm.job_name={json.dumps('job ' + payload)}",
                 f"slurm.partition={json.dumps('part ' + payload)}", f"slurm.env={json.dumps({'WEIRD': payload})}",
                 f"container.python={json.dumps(str(stub))}", "slurm.master_port=1", "slurm.gpus_per_node=0"]
    text, files = render(TINY_GRPO, tmp_path, *overrides)
    assert f"#SBATCH --job-name={shlex.quote('job ' + payload)}" in text.splitlines()
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    bash_n(script)
    shellcheck(script)
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists()
    calls = [json.loads(line) for line in Path(env["STUB_LOG"]).read_text().splitlines()]
    train = calls[-1]["argv"]
    assert train[:2] == ["-m", "megatron_rl.launch"] and calls[-1]["weird"] == payload
    tail = train[train.index("megatron_rl.slurm.stop_relay") + 1:]
    assert tail == [str(files.run_dir / "slurm" / "stop-42"), "--", str(stub), "-m", "megatron_rl.cli", "train",
                    str(files.recipe), "--resume"]
    assert files.run_dir.name == "run " + payload and files.run_dir.is_dir()

def test_preflight_reports_every_problem_and_starts_nothing(tmp_path: Path) -> None:
    env, stub = sandbox(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        text, _ = render(TINY_GRPO, tmp_path, "container.runtime=apptainer", f"container.image={tmp_path / 'no.sif'}",
                         "slurm.gpus_per_node=4", f"slurm.master_port={port}", f"container.python={stub}")
        script = tmp_path / "job.sbatch"
        script.write_text(text)
        # No nvidia-smi, no apptainer: drop the directories that hold them (on a GPU machine).
        env["PATH"] = os.pathsep.join(d for d in env["PATH"].split(os.pathsep)
                                      if not any((Path(d) / t).exists() for t in ("nvidia-smi", "apptainer")))
        proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    for key in ("slurm.gpus_per_node", "container.runtime", "container.image", "slurm.master_port",
                "nothing was started"):
        assert key in proc.stderr, (key, proc.stderr)
    assert not Path(env["STUB_LOG"]).exists()                # neither the import check nor the trainer ran

# ------------------------------------------------------------------------------------ stop relay
CHILD = """
import os, signal, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # same process group
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
open(sys.argv[1], "w").write("ready")
while not got:
    time.sleep(0.05)
alive = helper.poll() is None          # the helper must not have been signalled
helper.kill()
sys.exit(7 if alive else 1)
"""

def test_stop_relay_signals_the_trainer_process_alone(tmp_path: Path) -> None:
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.slurm.stop_relay", str(stop), "--",
                             sys.executable, "-c", CHILD, str(ready)], cwd=REPO)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.touch()
    assert proc.wait(timeout=30) == 7
