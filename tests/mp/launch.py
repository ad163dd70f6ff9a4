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


def torchrun_nodes(worker: str, *args: str, nnodes: int = 2, nproc: int = 2, timeout: float = 600,
                   cuda: bool = False) -> list[str]:
    """`worker` as `nnodes` "nodes" on this machine: one torchrun agent per node (--node-rank k,
    a static rendezvous on 127.0.0.1), `nproc` ranks each, so LOCAL_RANK / LOCAL_WORLD_SIZE are
    what a real multi-node job sees. With `cuda`, node k sees GPUs k·nproc … (k+1)·nproc − 1 as
    its own 0 … nproc − 1, as a node of its own would. Returns each agent's output. The agents share
    a port picked free beforehand, so a start that lost it to another process runs once more."""
    for attempt in (1, 2):
        codes, outs = _run_nodes(worker, args, nnodes, nproc, timeout, cuda, free_port())
        if attempt == 1 and any(codes) and "Address already in use" in outs[0]:
            continue
        if any(codes):
            tails = ["\n".join(out.splitlines()[-120:]) for out in outs]
            raise AssertionError(f"{worker} failed (exits {codes}):\n" + "\n---\n".join(tails))
        return outs
    raise AssertionError("unreachable")


def _run_nodes(worker: str, args: tuple[str, ...], nnodes: int, nproc: int, timeout: float, cuda: bool,
               port: int) -> tuple[list[int], list[str]]:

    def env(k: int) -> dict[str, str]:
        gpus = ",".join(str(k * nproc + i) for i in range(nproc))
        return dict(os.environ, CUDA_VISIBLE_DEVICES=gpus if cuda else "", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))

    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                               f"--nproc-per-node={nproc}", f"--node-rank={k}", "--master-addr=127.0.0.1",
                               f"--master-port={port}", str(REPO / "tests" / "mp" / worker), *args],
                              env=env(k), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k in range(nnodes)]
    try:
        outs = [procs[0].communicate(timeout=timeout)[0]]
        if procs[0].returncode and "Address already in use" in outs[0]:
            for p in procs[1:]:
                p.kill()        # dialling a store that never came up: until its timeout otherwise
        outs += [p.communicate(timeout=timeout)[0] for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs
