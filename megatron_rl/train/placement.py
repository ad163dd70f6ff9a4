"""Where a run's rollout servers live: one colocated server per trainer node.

Each node's first rank (LOCAL_RANK 0) starts the node's server on that node's GPUs (TP × DP of
them, `rollout-server-fits-a-node` in config/rules.py) and publishes it under
`<run>/rollout/node_<k>/rollout/server.json` (+ `token`), the same shape as the sbatch script's
disaggregated `rollout_servers/<host>/rollout/`. Global rank 0 waits for every node's file and
drives all servers (generation, weight sync, verification, sleep/wake); the other ranks of a node
start nothing. A server that fails to start leaves `server.error` beside its log, which rank 0
reports instead of waiting out its timeout.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..config.schema import RecipeConfig
from ..rollout.server import RolloutServer, ServerError
from ..rollout.shm import remove_stale_and_say

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ERROR_FILE = "server.error"
WAIT_MARGIN_S = 60.0
"""Beyond rollout.startup_timeout_s: the other nodes start their servers after their own model build."""


class PlacementError(ServerError):
    """A node's server did not come up, or cannot be reached from rank 0."""


@dataclass(frozen=True)
class NodePosition:
    node: int
    """This process's node (torchrun places a node's ranks contiguously: rank // ranks per node)."""
    nodes: int
    local_rank: int


def node_position() -> NodePosition:
    """From torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE; a plain `python` run is one node."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise PlacementError(f"LOCAL_WORLD_SIZE={per_node} does not divide the world size {world}: "
                             "every node must run the same number of trainer ranks")
    return NodePosition(rank // per_node, world // per_node, int(os.environ.get("LOCAL_RANK", rank % per_node)))


def node_dir(run_dir: Path, node: int) -> Path:
    """The server's own run dir: its files go to `<this>/rollout/` (token, server.json, server.log)."""
    return run_dir / "rollout" / f"node_{node}"


def start_node_servers(cfg: RecipeConfig, run_dir: Path, model_dir: str,
                       extra_args: list[str]) -> tuple[RolloutServer | None, list[RolloutServer]]:
    """Collective. Returns (the server this process started, if any; every server, on rank 0 only).

    Files of an earlier attempt are removed before anyone starts, behind a barrier, so that rank 0
    never attaches to a dead server's address."""
    pos = node_position()
    here = node_dir(run_dir, pos.node) / "rollout"
    if pos.local_rank == 0:
        for name in ("server.json", ERROR_FILE):
            (here / name).unlink(missing_ok=True)
        remove_stale_and_say(f"node {pos.node}: ")
    dist.barrier()
    own = _start_own(cfg, run_dir, model_dir, extra_args, pos) if pos.local_rank == 0 else None
    if dist.get_rank() != 0:
        return own, []
    assert own is not None, "global rank 0 is its node's first rank"
    peers = [n for n in range(pos.nodes) if n != pos.node]
    found = wait_for_servers(run_dir, peers, cfg.rollout.startup_timeout_s + WAIT_MARGIN_S)
    servers = [own] + [attach_peer(run_dir, n, found[n], cfg) for n in peers]
    if len(servers) > 1:
        print(f"[rollout] {len(servers)} servers, one per node: " + ", ".join(s.base_url for s in servers),
              flush=True)
    return own, servers


def _start_own(cfg: RecipeConfig, run_dir: Path, model_dir: str, extra_args: list[str],
               pos: NodePosition) -> RolloutServer:
    r = cfg.rollout
    server = RolloutServer(model_dir, node_dir(run_dir, pos.node), r, r.max_prompt_length + r.max_response_length,
                           extra_args=extra_args)
    try:
        server.start()
    except ServerError as exc:      # told to rank 0, which is waiting for this node's server.json
        server.rollout_dir.mkdir(parents=True, exist_ok=True)
        (server.rollout_dir / ERROR_FILE).write_text(f"{socket.gethostname()}: {exc}\n")
        raise
    return server


def wait_for_servers(run_dir: Path, nodes: list[int], timeout_s: float, poll_s: float = 1.0) -> dict[int, dict]:
    """The published server.json of each node in `nodes`; a PlacementError naming the missing ones
    (and any node's start-up error) when they do not all appear within `timeout_s`."""
    found: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for n in nodes:
            files = node_dir(run_dir, n) / "rollout"
            if n not in found and (files / ERROR_FILE).is_file():
                raise PlacementError(f"the rollout server of node {n} failed to start: "
                                     f"{(files / ERROR_FILE).read_text().strip()}")
            if n not in found and (files / "server.json").is_file():
                try:
                    found[n] = json.loads((files / "server.json").read_text())
                except ValueError:          # being written: read it on the next round
                    pass
        missing = [n for n in nodes if n not in found]
        if not missing:
            return found
        if time.monotonic() >= deadline:
            where = ", ".join(str(node_dir(run_dir, n) / "rollout") for n in missing)
            raise PlacementError(f"rollout server(s) of node(s) {missing} not published after {timeout_s:.0f}s "
                                 f"(rollout.startup_timeout_s + {WAIT_MARGIN_S:.0f}s); no server.json in {where} "
                                 "(see server.log there, and that node's trainer log)")
        time.sleep(poll_s)


def attach_peer(run_dir: Path, node: int, info: dict, cfg: RecipeConfig) -> RolloutServer:
    """Another node's server, as published. A loopback address only works on this very host."""
    host = info["url"].split("//", 1)[1].rsplit(":", 1)[0]
    if host in LOOPBACK and info.get("hostname", socket.gethostname()) != socket.gethostname():
        raise PlacementError(f"the rollout server of node {node} ({info.get('hostname')}) listens on {host}, "
                             f"which rank 0 on {socket.gethostname()} cannot reach: set rollout.host to each "
                             "node's address (the sbatch script passes rollout.host=$SLURMD_NODENAME)")
    return RolloutServer.attach(node_dir(run_dir, node), cfg.rollout)

