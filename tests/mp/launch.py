"""Run a torchrun worker from a test: 2 gloo processes on 127.0.0.1, one thread each.

CPU tests hide the GPUs (CUDA_VISIBLE_DEVICES=""): on a GPU machine the workers would otherwise
pick NCCL and put both ranks on one device. GPU tests pass `cuda=True`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.mp.common import free_port

REPO = Path(__file__).resolve().parents[2]


def cpu_env(**extra: str) -> dict[str, str]:
    """This process's environment with CUDA hidden: the code under test takes its CPU path."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", **extra)


def torchrun(worker: str, *args: str, nproc: int = 2, timeout: float = 600,
             cuda: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ) if cuda else cpu_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "megatron_rl.launch", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(REPO / "tests" / "mp" / worker), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"{worker} failed (exit {proc.returncode}):\n{tail}")
    return proc
