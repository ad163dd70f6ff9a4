"""`megatron-rl sbatch`: every recipe renders to a script that bash and shellcheck accept; recipe
values stay literal; the script's logic runs in a sandbox with stand-ins for srun/scontrol; and on
a real one-node Slurm (tests/slurm/start_slurm.sh) the tiny recipe trains, survives scancel +
resubmission, and a SIGUSR1 before the time limit checkpoints, requeues and resumes (one run goes
through all three, `journey`, and each test asserts its part).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.rollout import REPO
from tests.helpers.slurm import CPU_JOB, _free_port_pair, job_info


def submit(env: dict[str, str], out: Path, name: str, *overrides: str) -> tuple[str, Path]:
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "sbatch", str(REPO / "recipes/tiny/grpo.yaml"),
                           *CPU_JOB, f"logging.output_dir={out}", f"logging.run_name={name}",
                           f"slurm.master_port={_free_port_pair()}", *overrides, "--submit"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = next(line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("Submitted batch job"))
    return job, out / name




def wait_for(env: dict[str, str], job: str, run: Path, done: object, timeout: float = 360) -> dict[str, str]:
    """Poll until `done(info)`; on time-out fail with the job's state and the end of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(env, job)
        if done(info):
            return info
        time.sleep(0.5)       # steps take ~1 s here: the tests act between two of them
    logs = "".join(p.read_text()[-3000:] for p in (run / "slurm").glob("*.out"))
    pytest.fail(f"job {job} stuck in {job_info(env, job).get('JobState')}; log:\n{logs}")


def finished(info: dict[str, str]) -> bool:
    return info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def log_of(run: Path, job: str) -> str:
    return (run / "slurm" / f"{job}.out").read_text()


def test_sbatch_reads_quoted_options_literally(slurm: dict[str, str], tmp_path: Path) -> None:
    """sbatch parses #SBATCH lines itself: the quoted job name and log path must arrive intact."""
    job, run = submit(slurm, tmp_path / "out dir", "held", "slurm.job_name='name with $(x) spaces'",
                      "slurm.extra_sbatch=[--hold]")
    try:
        info = job_info(slurm, job)
        assert info["JobState"] == "PENDING"
        text = subprocess.run(["scontrol", "show", "job", job], env=slurm, capture_output=True, text=True).stdout
        assert "JobName=name with $(x) spaces" in text and f"StdOut={run}/slurm/{job}.out" in text
        # The resource lines as Slurm took them: whole node, all of its memory.
        assert info["OverSubscribe"] == "NO" and info["MinMemoryNode"] == "0", info
    finally:
        subprocess.run(["scancel", job], env=slurm)


def test_a_gpu_job_whose_container_sees_no_gpu_refuses_to_start(slurm: dict[str, str], tmp_path: Path) -> None:
    """The recipe expects a GPU; Slurm grants one (the CI node's stand-in) and the host's nvidia-smi
    lists it, but CUDA inside the job's Python sees none (as in a container started without --nv):
    the preflight refuses with one message and nothing trains on the CPU."""
    host_bin = tmp_path / "host bin"
    host_bin.mkdir()
    (host_bin / "nvidia-smi").write_text('#!/bin/bash\necho "GPU 0: stand-in (UUID: GPU-0)"\n')
    (host_bin / "nvidia-smi").chmod(0o755)
    env = dict(slurm, PATH=f"{host_bin}:{slurm['PATH']}")
    job, run = submit(env, tmp_path, "gpu", "slurm.gpus_per_node=1", "trainer.max_steps=1")
    info = wait_for(env, job, run, finished)
    log = log_of(run, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", log[-3000:]
    assert info["TresPerNode"] == "gres:gpu:1", info
    refusal = [line for line in log.splitlines() if "inside the container:" in line]
    assert len(refusal) == 1, log[-3000:]
    for expected in ("1 GPU(s) per node expected", "CUDA sees 0", "refusing to fall back to the CPU",
                     "CUDA_VISIBLE_DEVICES='0'", "slurm.gpus_per_node=0"):
        assert expected in refusal[0], (expected, refusal[0])
    assert "nothing was started" in log and "trainer on" not in log
    assert not (run / "metrics.jsonl").exists()


STEPS = 10
"""The journey's run: enough steps for a scancel, a resubmission and a SIGUSR1 between them."""


@dataclass(frozen=True)
class Journey:
    """One run through what a user's job meets: scancel, resubmission (resume), SIGUSR1 before the
    time limit (checkpoint, requeue, resume), completion. Three job starts instead of one job per
    test (each start is a vLLM server and a trainer); each test below asserts its part."""

    run: Path
    cancelled_job: str
    cancelled: dict[str, str]
    """The first job's info once scancel's processes were gone."""
    steps_before_cancel: list[int]
    job: str
    """The resubmission, requeued once by SIGUSR1 and then completed."""
    final: dict[str, str]


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}" / "complete.json"


@pytest.fixture(scope="module")
def journey(slurm: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Journey:
    # The journey is about the job's life, not learning: the tiny recipe's lr (1e-3) can collapse a
    # 10-step run (seen once in CI, format rate to 0 from step 6), and run health would then stop it
    # before its last step. That stop has its own tests (tests/e2e/test_run_health.py, tests/unit/test_run_health.py).
    common = [f"trainer.max_steps={STEPS}", "checkpoint.save_interval=1", "trainer.stop_when_collapsed=0"]
    out = tmp_path_factory.mktemp("journey")
    job, run = submit(slurm, out, "journey", *common)
    wait_for(slurm, job, run, lambda info: _checkpoint(run, 1).is_file() or finished(info))
    assert _checkpoint(run, 1).is_file(), log_of(run, job)[-3000:]
    subprocess.run(["scancel", job], env=slurm, check=True)
    # Gone from the queue: no process of the job is left (COMPLETING is over).
    cancelled = wait_for(slurm, job, run, finished)
    before = steps(run)
    assert before and before[-1] < STEPS - 2, log_of(run, job)[-3000:]

    job2, _ = submit(slurm, out, "journey", *common)    # same run name: the new job resumes
    beyond = _checkpoint(run, before[-1] + 1)
    wait_for(slurm, job2, run, lambda info: beyond.is_file() or finished(info))
    assert beyond.is_file() and not finished(job_info(slurm, job2)), log_of(run, job2)[-3000:]
    # What Slurm does slurm.signal_before_s before the time limit (--signal=B:USR1@N).
    subprocess.run(["scancel", "--signal=USR1", "--batch", job2], env=slurm, check=True)
    wait_for(slurm, job2, run, lambda info: info.get("Restarts") == "1" and info.get("JobState") == "PENDING")
    # A requeued job is held back ~2 minutes (BeginTime); let it start now. Not in the second the
    # first attempt ended: slurmd revokes that attempt's credential with one-second resolution and
    # kills a start within it ("Job credential revoked", seen here).
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job2}", "StartTime=now"], env=slurm, check=True)
    final = wait_for(slurm, job2, run, lambda info: info.get("Restarts") == "1" and finished(info))
    return Journey(run, job, cancelled, before, job2, final)


def test_tiny_recipe_trains_as_a_slurm_job(journey: Journey) -> None:
    run, job, info = journey.run, journey.job, journey.final
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log_of(run, job)[-3000:]
    assert steps(run) == list(range(1, STEPS + 1))
    assert _checkpoint(run, STEPS).is_file()
    assert (run / "hf_export").is_dir() and "training finished" in log_of(run, job)
    # Whole node: every CPU to the one task; the rank gets them less the colocated server's share.
    cpus = int(info["NumCPUs"])
    assert cpus == os.cpu_count() and info["OverSubscribe"] == "NO" and info["MinMemoryNode"] == "0"
    threads = max(1, cpus - 3)          # tiny: 1 API server + 1 engine core + 1 worker
    assert f"per node {cpus} CPUs, 3 for a colocated server, OMP_NUM_THREADS={threads} per rank" in log_of(run, job)
    assert "memory --mem=0" in log_of(run, job)


def test_scancel_then_resubmit_resumes_and_logs_each_step_once(journey: Journey) -> None:
    run = journey.run
    assert journey.cancelled["JobState"] == "CANCELLED", log_of(run, journey.cancelled_job)[-3000:]
    assert "training finished" not in log_of(run, journey.cancelled_job)
    resumed = log_of(run, journey.job).split("(restart 1)")[0]         # the resubmission's first attempt
    assert "(restart 0)" in resumed and "[resume] from" in resumed, resumed[-3000:]
    assert steps(run) == list(range(1, STEPS + 1))                     # every step logged once


def test_usr1_before_the_time_limit_checkpoints_requeues_and_resumes(journey: Journey) -> None:
    run, job, info = journey.run, journey.job, journey.final
    log = log_of(run, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    for expected in ("[train] SIGUSR1: checkpointed step", f"requeueing job {job}", "(restart 1)"):
        assert expected in log, (expected, log[-4000:])
    assert "[resume] from" in log.split("(restart 1)", 1)[1], log[-4000:]     # the requeued attempt resumed
    assert steps(run) == list(range(1, STEPS + 1))
    assert (run / "hf_export").is_dir()
    assert not (run / "slurm" / f"stop-{job}").exists()          # the requeued job's stop request is gone
