"""A one-node Slurm of our own for the e2e tests (one per session), and the tiny CPU job they submit."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import pytest

from tests.helpers.rollout import REPO, demo_assets

START_SLURM = REPO / "tests" / "slurm" / "start_slurm.sh"


# The tiny CPU run of the trainer tests, as a Slurm job on this machine's one node.
CPU_JOB = ["trainer.global_batch_size=16", "rollout.n=4", "trainer.micro_batch_size=4", "rollout.max_concurrency=1",
           "container.runtime=none", "parallelism.gpus_per_node=1", "slurm.gpus_per_node=0"]


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as a, socket.socket() as b:
                    a.bind(("", port))
                    b.bind(("", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two adjacent free ports")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201  (Iterator[dict[str, str]])
    """A one-node Slurm of our own (own state dir and ports), stopped at the end of the session."""
    missing = [t for t in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"Slurm not installed ({', '.join(missing)}); tools/install_ci_system_deps.sh installs it")
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm runs slurmd, which needs root")
    demo_assets()                       # the tiny recipes' model and data, checked when a job is rendered
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, MRL_SLURM_PORT=str(_free_port_pair()))
    proc = subprocess.run([str(START_SLURM), "start", str(state)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        yield dict(os.environ, SLURM_CONF=proc.stdout.strip().splitlines()[-1], OMP_NUM_THREADS="1")
    finally:
        subprocess.run([str(START_SLURM), "stop", str(state)], env=env, capture_output=True, timeout=120)


def job_info(env: dict[str, str], job: str) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    return dict(f.split("=", 1) for f in text.split() if "=" in f)
