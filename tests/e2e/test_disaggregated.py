"""Disaggregated rollout: the trainer attaches to servers it did not start (what the sbatch script
starts on rollout nodes), splits each step's prompts over them and syncs every one of them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from megatron_rl.rollout.server import RolloutServer
from tests.helpers.rollout import REPO, demo_assets, start_server
from tests.helpers.train import SMALL, metrics


def test_trainer_uses_and_syncs_every_external_server(tmp_path: Path, demo_weights_server: RolloutServer) -> None:
    servers_dir = tmp_path / "servers"
    servers_dir.mkdir()
    # Two rollout nodes: the session's shared server stands for one, a server of our own for the other.
    (servers_dir / "node-a").symlink_to(Path(demo_weights_server.run_dir))
    own = start_server(demo_assets()["model"], servers_dir / "node-b")
    servers = [demo_weights_server, own]
    try:
        cmd = [os.sys.executable, "-m", "megatron_rl.cli", "train", str(REPO / "recipes/tiny/grpo.yaml"), *SMALL,
               "trainer.max_steps=2", f"logging.output_dir={tmp_path}", "logging.run_name=run"]
        env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_RL_ROLLOUT_SERVERS=str(servers_dir))
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert "using 2 external server(s)" in proc.stdout
        rows = metrics(tmp_path / "run")
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["sync/verify_max_abs_diff"] <= 1e-4 for r in rows)   # checked on both servers
        for server in servers:                                   # both received every update
            assert server.rpc("mrl_weight_version") == [str(rows[-1]["weight_version"])]
            assert server.alive()                                # and were left running
        assert not list((tmp_path / "run" / "rollout").glob("node_*"))   # no local server started
        assert (tmp_path / "run" / "rollout" / "sync").is_dir()  # buckets went through the shared dir
    finally:
        own.stop()
