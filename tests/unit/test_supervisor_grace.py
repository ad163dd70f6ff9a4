"""`ServerSupervisor.recover` after an answered error (pure logic; the real server's life is in
tests/integration/test_supervisor.py and test_server_dies_whole.py). vLLM answers HTTP 500
"Executor failed" as soon as one TP worker dies, up to a second before the watch kills the group:
that error must still count as the crash it is (bench/faults.py, sync mode, a worker killed in
/update_weights ended the run once)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import httpx

from megatron_rl.rollout.server import RolloutServer, ServerError
from megatron_rl.rollout.supervisor import WATCH_GRACE_S, ServerSupervisor


class Server:
    """Alive until `dies_at` (monotonic seconds), then restarted by `restart`."""

    external = False
    rollout_dir = Path("/nonexistent")

    def __init__(self, dies_after_s: float | None) -> None:
        self.dies_at = None if dies_after_s is None else time.monotonic() + dies_after_s
        self.restarts = 0

    def alive(self) -> bool:
        return self.restarts > 0 or self.dies_at is None or time.monotonic() < self.dies_at

    def healthy(self) -> bool:
        return self.alive()

    def restart(self) -> None:
        self.restarts += 1

    def rpc(self, method: str) -> list[int]:
        assert method == "mrl_weight_version"
        return [0]                                  # no weights sent yet: version 0 expected


def _recover(server: Server, error: Exception) -> tuple[bool, float]:
    start = time.monotonic()
    got = ServerSupervisor(cast(RolloutServer, server)).recover(error, "the update")
    return got, time.monotonic() - start


def test_a_server_error_answered_just_before_the_watch_kills_the_group_is_a_crash() -> None:
    server = Server(dies_after_s=1.0)
    restarted, _ = _recover(server, ServerError("/update_weights: HTTP 500: Executor failed"))
    assert restarted and server.restarts == 1


def test_a_server_that_stays_up_is_not_restarted_after_the_grace_and_a_transport_error_waits_none() -> None:
    server = Server(dies_after_s=None)
    restarted, waited = _recover(server, ServerError("/generate: HTTP 400: bad request"))
    assert not restarted and server.restarts == 0 and WATCH_GRACE_S <= waited < WATCH_GRACE_S + 1.0
    error: Any = httpx.ReadError("reset")
    restarted, waited = _recover(server, error)
    assert not restarted and waited < 0.5
