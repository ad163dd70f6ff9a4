"""Rank 0's side of the per-node servers (train/fleet.py), pure logic: waiting for the nodes'
published addresses, a node's start-up error, a loopback address on another host, and which node
a rank is on. The real two-node run is tests/e2e/test_colocated_nodes.py."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_rl.megatron import cpu_compat

cpu_compat.apply()   # as `megatron-rl train` does: the fleet imports the actor and the weight sync

from megatron_rl.config import load_recipe  # noqa: E402
from megatron_rl.train.fleet import (  # noqa: E402
    ERROR_FILE,
    PlacementError,
    attach_published,
    node_dir,
    node_position,
    wait_for_servers,
)
from tests.helpers.rollout import REPO  # noqa: E402


def publish(run: Path, node: int, info: dict | str, name: str = "server.json") -> None:
    where = node_dir(run, node) / "rollout"
    where.mkdir(parents=True, exist_ok=True)
    (where / name).write_text(json.dumps(info) if name == "server.json" else str(info))


def test_waits_until_every_node_has_published(tmp_path: Path) -> None:
    publish(tmp_path, 1, {"url": "http://n1:1"})
    late = threading.Timer(0.5, publish, (tmp_path, 2, {"url": "http://n2:2"}))
    late.start()
    start = time.monotonic()
    found = wait_for_servers(tmp_path, [1, 2], timeout_s=30, poll_s=0.05)
    assert found == {1: {"url": "http://n1:1"}, 2: {"url": "http://n2:2"}}
    assert 0.4 < time.monotonic() - start < 10


def test_a_missing_node_is_named_after_the_timeout(tmp_path: Path) -> None:
    publish(tmp_path, 1, {"url": "http://n1:1"})
    with pytest.raises(PlacementError) as err:
        wait_for_servers(tmp_path, [1, 3], timeout_s=0.3, poll_s=0.05)
    msg = str(err.value)
    assert "node(s) [3] not published after 0s" in msg and str(node_dir(tmp_path, 3) / "rollout") in msg
    assert "rollout.startup_timeout_s" in msg


def test_a_node_that_failed_to_start_is_reported_at_once(tmp_path: Path) -> None:
    publish(tmp_path, 2, "gpu07: rollout server exited with code 1 while starting; see x/server.log", ERROR_FILE)
    start = time.monotonic()
    with pytest.raises(PlacementError, match="node 2 failed to start: gpu07: rollout server exited with code 1"):
        wait_for_servers(tmp_path, [1, 2], timeout_s=60, poll_s=0.05)
    assert time.monotonic() - start < 5                      # not after the 60 s timeout


def test_loopback_server_of_another_host_is_refused(tmp_path: Path) -> None:
    cfg = load_recipe(REPO / "recipes/tiny/grpo.yaml")
    info = {"url": "http://127.0.0.1:9", "hostname": socket.gethostname() + "-other"}
    with pytest.raises(PlacementError, match=r"node 1 \(.*-other\) listens on 127\.0\.0\.1.*rollout\.host"):
        attach_published(node_dir(tmp_path, 1), "node 1", info, cfg)


def test_node_position_from_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_world_size", lambda: 16)
    monkeypatch.setattr(dist, "get_rank", lambda: 11)
    monkeypatch.setitem(os.environ, "LOCAL_WORLD_SIZE", "8")
    monkeypatch.setitem(os.environ, "LOCAL_RANK", "3")
    pos = node_position()
    assert (pos.node, pos.nodes, pos.local_rank) == (1, 2, 3)
    monkeypatch.setitem(os.environ, "LOCAL_WORLD_SIZE", "5")
    with pytest.raises(PlacementError, match="LOCAL_WORLD_SIZE=5 does not divide the world size 16"):
        node_position()
