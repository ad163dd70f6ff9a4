"""Control requests (reseed, the weight sync's engine round, verification) reuse one connection per
thread: a new httpx.Client per request cost ~45 ms of CPU, more than the request itself."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout import server as server_mod
from megatron_rl.rollout.server import RolloutServer, control_client


class Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"                 # keep-alive, as uvicorn
    peers: list[tuple[str, int]] = []
    closing = False                               # per connection (one handler per connection)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.closing:
            # As uvicorn after an exception behind a 500: the answer had no `Connection: close`,
            # but the connection is closed right after it, here at the worst moment for the
            # client (its next request on it is already sent), which the race can give.
            self.close_connection = True
            return
        Recorder.peers.append(self.client_address)
        self.closing = self.path == "/fail"
        self.send_response(500 if self.closing else 200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RolloutServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    Recorder.peers = []
    try:
        yield RolloutServer("model", tmp_path, RolloutConfig(), 64, token="t", port=httpd.server_address[1],
                            external=True)
    finally:
        httpd.shutdown()


def test_control_requests_of_a_thread_share_one_connection(server: RolloutServer) -> None:
    for path in ("/pause", "/update_weights", "/resume"):
        server.post(path, {})
    assert len(Recorder.peers) == 3 and len(set(Recorder.peers)) == 1        # one TCP connection


def test_each_thread_has_its_own_client(server: RolloutServer) -> None:
    key = (server.base_url, 0, 0)
    mine: list[object] = []
    worker = threading.Thread(target=lambda: mine.append(control_client(key)))
    worker.start()
    worker.join()
    assert mine[0] is not control_client(key) and control_client(key) is control_client(key)


def test_a_restarted_server_is_reached_on_a_new_connection(server: RolloutServer) -> None:
    """A connection kept to the killed process would be reset under the first request."""
    server.post("/pause", {})
    old = control_client((server.base_url, 0, server.restarts))
    server.restarts += 1                                   # as `restart` counts a new process
    server.post("/resume", {})
    assert len(set(Recorder.peers)) == 2
    assert old.is_closed                                   # the earlier process's client is gone


def test_an_idle_connection_is_not_reused_past_the_keepalive(server: RolloutServer,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropped before the server's own keep-alive (uvicorn's 5 s) could close it under a request."""
    assert server_mod.KEEPALIVE_S < 5.0
    monkeypatch.setattr(server_mod, "_http", threading.local())
    monkeypatch.setattr(server_mod, "KEEPALIVE_S", 0.2)
    server.post("/pause", {})
    time.sleep(0.5)
    server.post("/resume", {})
    assert len(set(Recorder.peers)) == 2


def test_after_a_500_answer_the_next_request_opens_a_new_connection(server: RolloutServer) -> None:
    server.post("/pause", {})
    with pytest.raises(server_mod.ServerError, match="/fail: HTTP 500"):
        server.post("/fail", {})
    server.post("/resume", {})                                # not on the closed connection: a fresh one
    assert len(Recorder.peers) == 3 and Recorder.peers[0] == Recorder.peers[1] != Recorder.peers[2]


def test_rollout_clients_share_one_tls_context_that_still_verifies_certificates() -> None:
    import ssl

    from megatron_rl.rollout.client import tls_context

    ctx = tls_context()
    assert tls_context() is ctx                                   # built once, not per client
    # httpx's default, not a weaker one: certificates and host names are still checked.
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] > 0
