"""Host memory and the GPU terms outside the model state (`planner/host.py`), measured on CPU where
the code can be measured: the rollout batch a rank holds (a real `build_batch`), the samples'
Python objects (tracemalloc), the `shm` transport's segments (a real `SharedSegmentTransport` writing a
model's weights); the rest by hand from the formula the module cites."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.planner import count_params
from megatron_rl.planner.host import (
    GATHER_CHUNK_BYTES,
    NCCL_PACKED_BYTES,
    batch_tensor_bytes,
    gpu_extra_terms,
    largest_tensor,
    route_bytes_per_token,
    route_host_bytes,
    sample_object_bytes,
)
from megatron_rl.planner.memory import GB, Hardware
from megatron_rl.planner.params import Shard
from megatron_rl.planner.plan import estimate
from megatron_rl.planner.timing import Workload
from megatron_rl.train.batch import Scores, build_batch
from megatron_rl.types import RolloutGroup, Sample

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
HF = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=4096, hidden_size=64,
          intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, num_experts=300, num_experts_per_tok=4, tie_word_embeddings=False)


def _groups(prompts: int, n: int, prompt: int, response: int, layers: int, topk: int, experts: int,
            seed: int = 0) -> list[RolloutGroup]:
    rng = np.random.default_rng(seed)
    dtype = np.uint8 if experts <= 256 else np.uint16
    groups = []
    for p in range(prompts):
        prompt_ids = [int(x) for x in rng.integers(1000, 4000, prompt)]
        samples = [Sample(prompt_ids=prompt_ids, response_ids=[int(x) for x in rng.integers(1000, 4000, response)],
                          response_logprobs=[float(x) for x in -rng.random(response)],
                          routed_experts=rng.integers(0, experts, (prompt + response - 1, layers, topk)).astype(dtype))
                   for _ in range(n)]
        groups.append(RolloutGroup(p, {}, samples))
    return groups


def _tensor_bytes(batch: Any) -> int:
    return sum(v.nbytes for v in batch.__dict__.values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("experts", [200, 300], ids=["uint8-routes", "int16-routes"])
def test_batch_tensors_match_build_batch(experts: int) -> None:
    hf = dict(HF, num_experts=experts)
    params = count_params(hf)
    groups = _groups(3, 4, 20, 30, 3, 4, experts)
    seq_len = 64
    scores = Scores([""] * 12, [0.0] * 12, [{}] * 12, {})
    batch = build_batch(groups, scores, seq_len, 0).batch
    # The log-prob phase adds π_old and π_ref, [N, L − 1] fp32 like the rollout's.
    lp = torch.zeros(12, seq_len - 1)
    batch = dataclasses.replace(batch, old_logprobs=lp, ref_logprobs=lp.clone())
    assert batch.routes is not None       # compact, not a tensor of the batch (`route_host_bytes`)
    assert _tensor_bytes(batch) == batch_tensor_bytes(12, seq_len, params, ref=True)
    no_ref = dataclasses.replace(batch, ref_logprobs=None)
    assert _tensor_bytes(no_ref) == batch_tensor_bytes(12, seq_len, params, ref=False)


@pytest.mark.parametrize("experts", [200, 300], ids=["uint8-routes", "int16-routes"])
def test_route_bytes_match_the_store_and_one_expanded_microbatch(experts: int) -> None:
    """`route_host_bytes` against the real objects: rank 0's store holds every sample's compact
    array, a replica's share holds 1/DP of them, one expanded micro-batch is tokens × (ids + flag),
    and the dense batch of before is what `routes_batch` built."""
    from megatron_rl.rollout.routes import routes_batch
    from megatron_rl.route_rows import RouteRows, hold_on_rank0

    params = count_params(dict(HF, num_experts=experts))
    per_token = route_bytes_per_token(params)
    rows, seq_len, prompt, response, dp, mb_tokens = 12, 64, 20, 30, 4, 2 * 64
    groups = _groups(3, 4, prompt, response, 3, 4, experts)
    arrays = [s.routed_experts for g in groups for s in g.samples]
    dense = routes_batch(arrays, seq_len)
    assert dense is not None
    want = route_host_bytes(rows, seq_len, dp, per_token, mb_tokens, prompt + response - 1)
    sent = [s.routed_experts for g in hold_on_rank0(groups) for s in g.samples]      # what the others get
    rank0 = RouteRows.of_samples([s.routed_experts for g in groups for s in g.samples], seq_len)
    other = RouteRows.of_samples(sent, seq_len)
    assert rank0 is not None and other is not None
    expanded = sum(t.nbytes for t in rank0.select(range(2)).dense(2, mb_tokens // 2))
    assert rank0.store.held_bytes() + expanded == want.rank0
    assert other.store.held_bytes() == 0
    # A replica's share: what delivery leaves on a rank of replica 1 (rows 3..5 of the padded split).
    other.store.arrays = {i: rank0.store.arrays[i] for i in other.samples(range(3, 6))}
    assert other.store.held_bytes() + expanded == want.other
    assert sum(t.nbytes for t in dense) + sum(a.nbytes for a in arrays) == want.dense_before


def test_sample_objects_match_tracemalloc() -> None:
    params = count_params(HF)
    _groups(1, 2, 10, 10, 3, 4, 300, seed=2)      # one-time allocations (numpy's generator, caches) first
    # tracemalloc counts every thread's allocations (a pytest-xdist worker's, a server watcher's):
    # those only add, so the least of three measurements is the samples' own.
    used = None
    for _ in range(3):
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        groups = _groups(4, 8, 200, 100, 3, 4, 300, seed=1)
        got = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        used = got if used is None else min(used, got)
        del groups
    groups = _groups(4, 8, 200, 100, 3, 4, 300, seed=1)
    predicted = sample_object_bytes(32, 8, 200, 100, params, routes=True)
    # Lists over-allocate a little and each Sample has its own small overhead (measured: +7.5 %).
    assert abs(used / predicted - 1) < 0.15, (used, predicted)
    assert len(groups) == 4


def test_audit_15_routes_of_qwen3_next() -> None:
    # gpu-readiness-audit-2 #15: [2560, 4608, 48, 10] int16 on every rank = 11.3 GB (512 experts),
    # plus the samples' own arrays in the broadcast groups. Now: rank 0 keeps the compact arrays,
    # each other rank its replica's 1/16 of them, every rank one expanded micro-batch of 4608 tokens.
    cfg = load_recipe(RECIPES / "qwen3_next_80b_a3b/grpo.yaml", ["rollout.routing_replay=true"])
    params = count_params(json.loads((RECIPES / "models/qwen3_next_80b_a3b/config.json").read_text()))
    assert route_bytes_per_token(params) == 48 * 10 * 2
    assert cfg.parallelism.data_parallel_size == 16
    dense = 2560 * 4608 * (48 * 10 * 2 + 1)
    assert dense / GB == pytest.approx(11.3, abs=0.1)
    tokens = 4096 + 512 - 1                                   # the workload's caps: the upper bound
    b = route_host_bytes(2560, 4608, 16, 960, 4608, tokens)
    assert b.dense_before == dense + 2560 * tokens * 960
    assert b.rank0 == 2560 * tokens * 960 + 4608 * 961
    assert b.other == 160 * tokens * 960 + 4608 * 961
    assert b.dense_before / GB == pytest.approx(22.6, abs=0.1) and b.other / GB == pytest.approx(0.71, abs=0.01)
    with_routes = estimate(cfg, params, Hardware(8, 80.0), workload=Workload.of(cfg))
    without = estimate(load_recipe(RECIPES / "qwen3_next_80b_a3b/grpo.yaml"), params, Hardware(8, 80.0))
    terms = {t.key: t.gb for t in with_routes.nodes[0].host_terms}
    plain = {t.key: t.gb for t in without.nodes[0].host_terms}
    assert terms["batch"] == plain["batch"] and terms["samples"] == plain["samples"]
    assert "routes" not in plain
    assert terms["routes"] == pytest.approx((b.rank0 + 7 * b.other) / GB)
    # On the GPU: each in-flight micro-batch's ids as int64, 48 MoE layers × top-10 per token (at
    # PP 2 the peak stage's count: 2 on stage 0 under 1F1B, 1 on the last).
    gpu_terms = {t.key: t.gb for t in with_routes.stage.terms}
    in_flight = {0: 2, 1: 1}[with_routes.stage.stage]
    assert cfg.parallelism.pipeline_model_parallel_size == 2
    assert gpu_terms["routes"] == pytest.approx(in_flight * 4608 * 48 * 10 * 8 / GB)


class _NoServer:
    def post(self, *a: Any, **k: Any) -> Any:
        raise AssertionError("not reached: the test measures the segments before delivery")

    def rpc(self, *a: Any, **k: Any) -> list[Any]:
        raise AssertionError("not reached")


def test_shm_segments_hold_one_copy_of_the_weights(tmp_path: Path) -> None:
    from megatron_rl.sync.shm import SharedSegmentTransport

    params = count_params(HF)
    transport = SharedSegmentTransport([_NoServer()], root=tmp_path, segment_bytes=1 << 20)
    transport.begin(1)
    for block in params.blocks():
        if block.params:
            transport.send_bucket({f"t{id(block)}": torch.ones(block.params, dtype=torch.bfloat16)})
    files = list(Path(transport.dir).glob("segment-*.bin"))      # type: ignore[arg-type]
    allocated = sum(os.stat(f).st_blocks * 512 for f in files)
    transport.abort()
    # One bf16 copy (the planner's term), up to the 64-byte alignment and 4 KiB pages per tensor.
    expected = params.total * 2
    assert expected <= allocated <= expected + (4096 + 64) * len(list(params.blocks()))


def test_sync_gather_constants_match_the_code() -> None:
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()
    from megatron_rl.rollout.nccl_sender import PACKED_BUFFER_BYTES, PACKED_BUFFERS
    from megatron_rl.weights.sharding import GATHER_CHUNK_BYTES as CODE_CHUNK

    assert GATHER_CHUNK_BYTES == CODE_CHUNK and NCCL_PACKED_BYTES == PACKED_BUFFERS * PACKED_BUFFER_BYTES


def test_gather_term_by_hand() -> None:
    cfg = load_recipe(RECIPES / "qwen3_235b_a22b/grpo.yaml")
    params = count_params(json.loads((RECIPES / "models/qwen3_235b_a22b/config.json").read_text()))
    # The largest unsharded tensor is the 151,936 × 4,096 embedding / output: bf16, held twice.
    assert largest_tensor(params) == 151936 * 4096
    terms = {t.key: t.gb for t in estimate(cfg, params, Hardware(8, 80.0)).stage.terms}
    assert terms["sync_gather"] == pytest.approx(2 * 151936 * 4096 * 2 / GB)
    nccl = load_recipe(RECIPES / "qwen3_235b_a22b/grpo.yaml", ["rollout.weight_transfer=nccl"])
    terms = {t.key: t.gb for t in estimate(nccl, params, Hardware(8, 80.0)).stage.terms}
    assert terms["sync_gather"] == pytest.approx((2 * 151936 * 4096 * 2 + 2 * 2**30) / GB)
    assert "sync_bucket" not in {t.key for t in estimate(cfg, params, Hardware(8, 80.0)).stage.terms}   # shm
    # The GPU transports hold a bucket of gathered parts: rollout.sync_bucket_mb (512 MiB), and for
    # ipc (copied to every server GPU) at most IPC_BUCKET_CAP_BYTES (128 MiB).
    assert terms["sync_bucket"] == pytest.approx(512 * 2**20 / GB)
    for mb, held in ((512, 128), (64, 64)):
        ipc = load_recipe(RECIPES / "qwen3_235b_a22b/grpo.yaml", ["rollout.weight_transfer=ipc",
                                                                  f"rollout.sync_bucket_mb={mb}"])
        terms = {t.key: t.gb for t in estimate(ipc, params, Hardware(8, 80.0)).stage.terms}
        assert terms["sync_bucket"] == pytest.approx(held * 2**20 / GB), mb


def test_host_terms_by_hand_and_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    path = RECIPES / "qwen3_235b_a22b/grpo.yaml"
    cfg = load_recipe(path)
    params = count_params(json.loads((RECIPES / "models/qwen3_235b_a22b/config.json").read_text()))
    est = estimate(cfg, params, Hardware(8, 80.0), workload=Workload.of(cfg))
    trainer, rollout = est.nodes
    assert (trainer.role, trainer.nodes, rollout.role, rollout.nodes) == ("trainer node", 8, "rollout node", 4)
    terms = {t.key: t for t in trainer.host_terms}
    # CPU Adam: 8 ranks × (the offloaded states + a 4-byte fp32 gradient per parameter of the shard:
    # 4/12 of the 12-byte states).
    assert terms["cpu_adam"].gb == pytest.approx(8 * est.stage.host_gb * (1 + 4 / 12))
    # Padded rows of 4608: int64 tokens, fp32 mask + rollout/π_old/π_ref log-probs, advantages.
    assert terms["batch"].gb == pytest.approx(8 * 2560 * (8 * 4608 + 16 * 4607 + 4) / GB)
    # Servers on rollout nodes get every version over the network (delta, the default `auto`):
    # each owner keeps its part of the last one in its RAM to compare with (resident); rank 0's node
    # holds the most: TP rank 0 owns every non-expert tensor (TP 2, PP 1), and each of its 8 ranks
    # 1/64 of the experts. Each rollout node keeps its copy in its /dev/shm (the receiver's).
    experts = sum(b.params for b in params.blocks() if b.shard is Shard.EXPERT)
    node0 = 2 * (params.total - experts + 8 * experts / 64)
    assert not terms["sync_segments"].reclaimable and terms["sync_segments"].gb == pytest.approx(node0 / GB)
    assert "the owners' copies" in terms["sync_segments"].note
    assert terms["sync_segments"].label == "weight-sync segments (rank 0's node)"
    assert {t.key: t.gb for t in rollout.host_terms}["node_copy"] == pytest.approx(params.total * 2 / GB)
    off = estimate(load_recipe(path, ["rollout.sync_delta=off"]), params, Hardware(8, 80.0)).nodes[0]
    assert {t.key: t.gb for t in off.host_terms}["sync_segments"] == 0.0          # nothing to compare with
    assert trainer.host_total_gb == pytest.approx(sum(t.gb for t in trainer.host_terms if not t.reclaimable))
    assert trainer.host_fits and rollout.host_fits
    # A 256 GB node cannot hold 8 ranks' CPU Adam: the verdict says so and the exit status is 2.
    assert main(["plan", str(path), "--host-memory-gb", "256"]) == 2
    out = capsys.readouterr().out
    assert "trainer node (× 8)" in out and "a node's host memory does not" in out
    # Sleep level 1 keeps each server's weights in its node's RAM while it sleeps.
    slept = load_recipe(path, ["rollout.sleep_level=1"])
    node = estimate(slept, params, Hardware(8, 80.0)).nodes[1]
    assert {t.key: t.gb for t in node.host_terms}["vllm_sleep"] == pytest.approx(8 * est.rollout.weights_gb)


def test_a_sender_per_colocated_node_keeps_a_copy_in_every_nodes_ram() -> None:
    """Colocated over 8 nodes, each node's sender holds the update in its /dev/shm (RAM, not page
    cache: resident), and rank 0's GPU the bucket it broadcasts from."""
    cfg = load_recipe(RECIPES / "qwen3_next_80b_a3b/grpo.yaml")
    params = count_params(json.loads((RECIPES / "models/qwen3_next_80b_a3b/config.json").read_text()))
    est = estimate(cfg, params, Hardware(8, 80.0), workload=Workload.of(cfg))
    (trainer,) = est.nodes
    term = {t.key: t for t in trainer.host_terms}["sync_segments"]
    assert (term.label, term.note, term.reclaimable) == ("weight-sync segments (every node)", "/dev/shm (tmpfs)", False)
    assert term.gb == pytest.approx(params.total * 2 / GB)
    gpu = {t.key: t for t in gpu_extra_terms(cfg, params, 0, 1.0)}                   # rank 0's stage
    assert gpu["sync_gather"].gb == pytest.approx(max(GATHER_CHUNK_BYTES, largest_tensor(params) * 2) * 2 / GB)
    assert gpu["sync_bucket"].gb == pytest.approx(512 * 2**20 / GB) and "node senders" in gpu["sync_bucket"].note


def test_nccl_delta_keeps_the_owners_copies_in_ram_and_whole_syncs_keep_none() -> None:
    """`nccl` with delta (`sync/gpu.NcclTransport`): each owner keeps its part on its host
    (`sync/owners.py`), resident; the largest node's share is the term. Without delta: nothing."""
    from megatron_rl.planner.host import owner_copy_bytes

    params = count_params(json.loads((RECIPES / "models/qwen3_235b_a22b/config.json").read_text()))
    for delta, expected in (("auto", True), ("off", False)):
        cfg = load_recipe(RECIPES / "qwen3_235b_a22b/grpo.yaml", ["rollout.weight_transfer=nccl",
                                                                  f"rollout.sync_delta={delta}"])
        est = estimate(cfg, params, Hardware(8, 80.0), workload=Workload.of(cfg))
        term = {t.key: t for t in est.nodes[0].host_terms}["sync_segments"]
        if expected:
            largest = max(owner_copy_bytes(params, cfg, by_node=True).values())
            assert term.gb == pytest.approx(largest / GB) and not term.reclaimable and "nccl delta" in term.note
            assert 0 < largest < params.total * 2 / 4          # spread over the owners' nodes
        else:
            assert term.gb == 0.0 and term.note == "nccl"
