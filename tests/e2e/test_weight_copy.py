"""A disaggregated run's weights over the network (`sync/network.py`), as the sbatch script lays it
out: the shared server published as a rollout node's, with a weight-copy receiver beside it
(`rollout-server --weight-copy`; here a thread of this process, a directory standing for that
node's /dev/shm). The trainer finds the receiver, sends every version to it as deltas, every
version is verified on the server, and nothing goes through the shared run dir."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from megatron_rl.rollout.server import RolloutServer
from megatron_rl.sync.network import ADDRESS_FILE, announce_receiver, receive_for
from tests.helpers.servers import train_env
from tests.helpers.train import metrics, train_cmd


def test_a_trainer_sends_its_versions_over_the_network_to_a_rollout_nodes_copy(
        demo_weights_server: RolloutServer, tmp_path: Path) -> None:
    import subprocess

    from tests.helpers.rollout import REPO

    root = tmp_path / "rollout_servers"
    node = root / "node-a"
    (node / "rollout").mkdir(parents=True)
    for name in ("server.json", "token"):
        shutil.copy(demo_weights_server.rollout_dir / name, node / "rollout" / name)
    announce_receiver(node)
    shm = tmp_path / "node-a-dev-shm"
    shm.mkdir()
    stop = threading.Event()
    receiver = threading.Thread(target=receive_for, args=(root, "node-a", 1 << 20, lambda: not stop.is_set(), shm),
                                daemon=True)
    receiver.start()
    try:
        proc = subprocess.run(train_cmd("grpo.yaml", tmp_path, "r", "trainer.max_steps=3", "rollout.sync_delta=on"),
                              cwd=REPO, capture_output=True, text=True, timeout=900, env=train_env(root))
    finally:
        stop.set()
        receiver.join(timeout=60)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "weight sync: over the network (gloo) into each of the 1 rollout nodes' /dev/shm" in proc.stdout
    rows = [r for r in metrics(tmp_path / "r") if "sync/dense" in r]
    assert len(rows) == 3 and all(r["sync/dense"] == 0 for r in rows), rows      # every step's sync a delta
    assert all(r["sync/verify_max_abs_diff"] <= 1e-4 for r in rows)               # and verified on the server
    (version,) = {int(v) for v in demo_weights_server.rpc("mrl_weight_version")}
    assert version == 4                                      # the start-up's version 1, then a version a step
    assert not (tmp_path / "r" / "rollout" / "sync").exists()                     # nothing via the run dir
    assert not (root / ADDRESS_FILE).exists() and not list(shm.iterdir())         # closed: the copy is gone
    assert not receiver.is_alive()
