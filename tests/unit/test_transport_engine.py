"""The engine-driven transport's bookkeeping (pure logic; the real vLLM servers are in
test_weight_transfer.py and test_verification_servers.py): the order of the weight-transfer calls
of a round, re-initialising a restarted server's engine, one written copy and one manifest for
every server (write once), and a worker report that does not match what was sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.rollout.worker_ext import _views
from megatron_rl.weights.transport_engine import SharedSegmentTransport


class EngineRecorder:
    """Answers the routes as a server with the `mrl_shm` engine does, decoding every update's
    tensors from the files its manifest names."""

    def __init__(self, name: str) -> None:
        self.base_url, self.token, self.restarts = f"http://{name}", "t", 0
        self.calls: list[str] = []
        self.manifests: list[dict[str, Any]] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.version = 0
        self.lie = False

    def post(self, path: str, body: Any = None, params: Any = None, timeout: float = 600.0) -> None:
        self.calls.append(path)
        if path == "/update_weights":
            info = body["update_info"]
            self.manifests.append(info)
            segments = [torch.frombuffer(bytearray(Path(p).read_bytes()[:size]), dtype=torch.uint8)
                        for p, size in info["segments"]]
            self.loaded = {name: t.clone() for name, t in _views(info["tensors"], segments)}
            self.version = info["version"]
        if path == "/finish_weight_update":
            assert body == {"weight_version": str(self.version)}

    def rpc(self, method: str, *args: str, timeout: float = 600.0) -> list[Any]:
        self.calls.append(method)
        assert method == "mrl_loaded"
        return [{"version": self.version, "tensors": len(self.loaded) - self.lie}] * 2      # two workers


def _send(transport: SharedSegmentTransport, version: int, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    transport.begin(version)
    names = sorted(state)
    for start in range(0, len(names), 2):
        transport.send_bucket({n: state[n] for n in names[start:start + 2]})
    return transport.finish(names)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.w": torch.randn(33, 7, generator=g) for i in range(5)}


ROUND = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "mrl_loaded",
         "/reset_prefix_cache", "/resume"]


def test_round_order_and_a_restarted_server_gets_its_engine_initialised_again(tmp_path: Path) -> None:
    server = EngineRecorder("a")
    transport = SharedSegmentTransport([server], segment_bytes=1 << 10)
    try:
        result = _send(transport, 1, _state(0))
        assert result == {"version": 1, "tensors": 5, "workers": 2, "servers": 1}
        assert server.calls == ["/pause", "/init_weight_transfer_engine"] + ROUND[1:]
        server.calls = []
        _send(transport, 2, _state(1))
        assert server.calls == ROUND                                    # initialised once per server process
        server.restarts, server.calls = 1, []
        assert transport.links[0].resend_latest() == {"version": 2, "tensors": 5, "workers": 2}
        assert server.calls == ["/pause", "/init_weight_transfer_engine"] + ROUND[1:]
        assert all(torch.equal(server.loaded[n], t) for n, t in _state(1).items())
    finally:
        transport.close()


def test_two_servers_read_one_written_copy_per_version(tmp_path: Path) -> None:
    servers = [EngineRecorder("a"), EngineRecorder("b")]
    root = tmp_path / "sync"
    transport = SharedSegmentTransport(servers, root, segment_bytes=1 << 10)
    try:
        for version in (1, 2):
            state = _state(version)
            assert _send(transport, version, state)["servers"] == 2
            assert servers[0].manifests[-1] == servers[1].manifests[-1]            # the same manifest
            for s in servers:
                assert all(torch.equal(s.loaded[n], t) for n, t in state.items())
            dirs = list(root.iterdir())                       # the previous version went once both loaded
            assert len(dirs) == 1
            written = sum(f.stat().st_size for f in dirs[0].iterdir())
            assert written < 2 * sum(t.nbytes for t in state.values())               # one copy, not two
    finally:
        transport.close()


def test_a_worker_report_that_does_not_match_what_was_sent_is_an_error() -> None:
    server = EngineRecorder("a")
    server.lie = True
    transport = SharedSegmentTransport([server], segment_bytes=1 << 10)
    try:
        with pytest.raises(RuntimeError, match="loaded"):
            _send(transport, 1, _state(0))
        assert server.calls[-1] == "/resume"                                        # serving again
    finally:
        transport.close()
