"""A GPU rollout server started by a NUMA-pinned trainer rank gets the node's CPUs back
(gpu-readiness-audit-2 #16: `torchrun --numa-binding=node` pins LOCAL_RANK 0, and everything the
server starts would inherit it). The reset itself runs here in a real child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.rollout.affinity import CPUS_ENV, format_cpu_list, online_cpus, parse_cpu_list
from tests.mp.launch import REPO


def test_cpu_lists_round_trip() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpu_list({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11"
    assert format_cpu_list({5}) == "5" and parse_cpu_list("") == set()
    big = set(range(0, 56)) | set(range(112, 168))            # one socket's cores + their hyperthreads
    assert parse_cpu_list(format_cpu_list(big)) == big and format_cpu_list(big) == "0-55,112-167"


CHILD = """
import json, os, sys
os.sched_setaffinity(0, {0})                      # what the NUMA binding left the trainer rank
from megatron_rl.rollout.affinity import apply_server_affinity
got = apply_server_affinity(os.environ)
print(json.dumps({"before": [0], "after": sorted(got) if got is not None else None}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to see a pin widen")
def test_the_server_process_widens_an_inherited_pin() -> None:
    cpus = sorted(online_cpus() & os.sched_getaffinity(0))
    env = dict(os.environ, PYTHONPATH=str(REPO), **{CPUS_ENV: format_cpu_list(cpus)})
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["after"] == cpus
    env.pop(CPUS_ENV)                                 # CPU servers are not asked: their pins stay
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["after"] is None
