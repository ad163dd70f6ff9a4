"""The CPU affinity of a rollout server started by a trainer rank (standard library only: the
server's entry point applies it before vLLM starts any process).

`torchrun --numa-binding=node` (slurm/job.sbatch.in) pins each rank to its GPU's NUMA node, and a
colocated server started by LOCAL_RANK 0 would inherit that pin: its API server, engine cores and
workers for all the node's GPUs on GPU 0's NUMA node. The server gets the node's online CPUs back
(the kernel intersects them with the job's cpuset)."""

from __future__ import annotations

import os
from collections.abc import Iterable

CPUS_ENV = "MRL_SERVER_CPUS"
ONLINE = "/sys/devices/system/cpu/online"


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's list format: '0-3,8,10-11'."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The inverse of `parse_cpu_list`, runs folded: {0, 1, 2, 5} → '0-2,5'."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def online_cpus(path: str = ONLINE) -> set[int]:
    try:
        with open(path) as f:
            return parse_cpu_list(f.read())
    except OSError:
        return set(range(os.cpu_count() or 1))


def apply_server_affinity(env: dict[str, str] | os._Environ[str] = os.environ) -> set[int] | None:
    """In the server process, first thing: widen the affinity to $MRL_SERVER_CPUS (set by the
    trainer that starts a GPU server); the CPUs the kernel then allows, or None when not asked."""
    wanted = env.get(CPUS_ENV)
    if not wanted:
        return None
    try:
        os.sched_setaffinity(0, parse_cpu_list(wanted))
    except OSError:                 # none of them in this cpuset: keep what we have
        pass
    return os.sched_getaffinity(0)
