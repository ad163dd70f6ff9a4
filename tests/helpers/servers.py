"""One rollout server for the whole test session.

Starting a vLLM server costs 25-60 s on two cores (by load), most of the suite's time. Every test that does
not test a server's own life (start, kill, restart, sleep, re-configure) uses this one: a real
server on the warmed-up demo model, started on first use and stopped when the session ends.

It is laid out as the sbatch script lays out rollout nodes (`<dir>/<host>/rollout/server.json`), so
a trainer run attaches to it through the production path, `$MEGATRON_RL_ROLLOUT_SERVERS`
(`train_env`). Servers of a real run start from the run's checkpoint, and the trainer relies on it
(start-up verification before the first sync, adapter-only LoRA syncs): so before each test the
demo checkpoint is sent back when an earlier test left other weights (`demo_weights_server`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_rl.rollout.server import EXTERNAL_SERVERS_ENV, RolloutServer
from tests.helpers.rollout import demo_assets, start_server


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutServer]:
    """The shared server (fp32, eager, max_model_len 128, the tiny recipes' settings)."""
    server = start_server(demo_assets()["model"], tmp_path_factory.mktemp("demo_servers") / "node-0")
    try:
        yield server
    finally:
        server.stop()


_restored: list[int] = []        # versions this module sent to put the demo weights back


@pytest.fixture
def demo_weights_server(demo_server: RolloutServer, tmp_path: Path) -> RolloutServer:
    """The shared server holding the demo model's own weights: when a trainer or test left others
    there, the demo checkpoint is sent back first, through the production route (`mrl_shm`)."""
    assert demo_server.alive(), f"the shared rollout server died; see {demo_server.rollout_dir / 'server.log'}"
    (version,) = {int(v) for v in demo_server.rpc("mrl_weight_version")}
    if version == 0 or version in _restored:           # never synced, or last synced back here
        return demo_server
    from megatron_rl.sync.shm import SharedSegmentTransport
    from megatron_rl.weights.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(demo_assets()["model"])
    transport = SharedSegmentTransport([demo_server], tmp_path / "restore", segment_bytes=16 << 20)
    try:
        _restored.append(1_000_000 + len(_restored))
        transport.begin(_restored[-1])
        names = sorted(reader.names())
        transport.send_bucket({n: reader.get(n) for n in names})
        transport.finish(names)
    finally:
        transport.close()
    return demo_server


@pytest.fixture
def demo_servers_dir(demo_weights_server: RolloutServer) -> Path:
    """What `$MEGATRON_RL_ROLLOUT_SERVERS` points at, for a trainer run from the demo checkpoint.
    The server holds that checkpoint, as servers started for a run do: the trainer's start-up
    verification calibrates on it before the first sync, and LoRA syncs send only adapted tensors."""
    return Path(demo_weights_server.run_dir).parent


def train_env(servers_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a trainer run that attaches to the servers in `servers_dir`."""
    return dict(os.environ, OMP_NUM_THREADS="1", **{EXTERNAL_SERVERS_ENV: str(servers_dir)}, **extra)
