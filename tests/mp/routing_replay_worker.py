"""torchrun worker: routes recorded in one forward are replayed exactly under parallel layouts.

Run as `torchrun --nproc-per-node 2 tests/mp/routing_replay_worker.py HF_DIR OUT_JSON [BATCH_PT]`.
With BATCH_PT (a saved TrainBatch whose routes came from a vLLM server) step 1 is skipped.

1. TP1 (DP 2): an unreplayed forward of the tiny MoE; every router logs the ids it used; the test
   places them back at (row, position, layer) with its own map of the layout (DP rows, SP slices,
   s-major order, PP layers) and sums over ranks: the recorded routes [N, L, layers, topk] (uint8).
2. Before anything is perturbed, the batch is scored without replay (the trainer's own routing
   against the recorded one: `routing/mismatch_frac` and the log-prob gap to the rollout's).
3. At TP1, TP2/SP+EP2 (ETP1) and PP2: the router weights are perturbed (the same noise on every
   rank), then the batch is scored (a) with the routes but without replay, (b) with replay, and (c)
   trained on for one step with replay. Each forward's logged ids are placed back the same way.
Rank 0 writes, per layout, how many (token, layer) rows differ from the recorded ones in each
forward, the metric the actor reported, and how the tokens without a recorded route were routed.

The routes reach the actor as a training run's do: compact, held by rank 0 only (`hold_on_rank0`),
delivered to the ranks of each row's data-parallel replica before every forward
(`megatron/route_delivery.py`); each layout reports which samples every rank held after its first
forward. The test's reference is its own dense copy of the recorded routes.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

from megatron_rl.config.schema import AlgorithmConfig, ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel, unwrap  # noqa: E402
from megatron_rl.megatron.devices import init_distributed  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.route_rows import RouteRows, hold_on_rank0  # noqa: E402
from megatron_rl.types import RolloutGroup, Sample, TrainBatch  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from tests.mp.common import finish  # noqa: E402
from tests.mp.layouts_worker import make_batch  # noqa: E402

LAYOUTS = {
    "tp1": ParallelismConfig(),
    "tp2_sp_ep2": ParallelismConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                    expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    "pp2": ParallelismConfig(pipeline_model_parallel_size=2),
    # Full recompute re-runs the routers in backward, after later micro-batches were fed (1F1B).
    "pp2_recompute": ParallelismConfig(pipeline_model_parallel_size=2, recompute_granularity="full",
                                       recompute_method="uniform", recompute_num_layers=1),
}
MBS = 2
SHAPE = {"rows": 8, "length": 24}


def build(hf_dir: str, layout: ParallelismConfig) -> Actor:
    init_parallel(layout, seed=1234)
    hf = read_hf_config(hf_dir)
    recipe = build_model(hf, layout, torch.float32)
    actor = Actor(recipe, MBS, Training(TrainerConfig(lr=1e-3, clip_grad=1.0), layout, total_updates=10))
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    assert actor.routing is not None and actor.replay_routes
    return actor


def start_logs(actor: Actor) -> None:
    assert actor.routing is not None
    for r in actor.routing.routers:
        r.log, r.recompute_log = [], []


def placed(actor: Actor, num_layers: int, topk: int, recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's logged ids at their (row, position, layer), summed over ranks, and how many
    ranks filled each place (must be exactly 1). The map is the test's own, not the actor's."""
    assert actor.routing is not None
    rows_total, length = SHAPE["rows"], SHAPE["length"]
    out = torch.zeros(rows_total, length, num_layers, topk, dtype=torch.long)
    filled = torch.zeros(rows_total, length, num_layers, dtype=torch.long)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    per_rank = rows_total // dp
    s_local = length // tp if actor.config.sequence_parallel else length
    p0 = tp_rank * s_local if actor.config.sequence_parallel else 0
    owner = actor.config.sequence_parallel or tp_rank == 0        # without SP, TP ranks route the same rows
    for r in actor.routing.routers:
        log = r.recompute_log if recompute else r.log
        assert log is not None and len(log) == per_rank // MBS, (len(log or []), per_rank)
        for i, ids in enumerate(log):
            rows = slice(dp_rank * per_rank + i * MBS, dp_rank * per_rank + (i + 1) * MBS)
            grid = ids.view(s_local, MBS, topk).transpose(0, 1)          # s-major then b
            if owner:
                out[rows, p0:p0 + s_local, r.layer_number - 1] = grid.sort(dim=-1).values
                filled[rows, p0:p0 + s_local, r.layer_number - 1] += 1
        if recompute:
            r.recompute_log = None
        else:
            r.log = None
    dist.all_reduce(out)
    dist.all_reduce(filled)
    return out, filled


def perturb_routers(actor: Actor, scale: float) -> None:
    """The same noise on every rank (router weights are replicated): seeded by the layer."""
    for m in unwrap(actor.model).modules():
        if hasattr(m, "router_replay") and hasattr(m, "weight"):
            g = torch.Generator().manual_seed(100 + int(m.layer_number))
            noise = torch.randn(m.weight.shape, generator=g) * scale * float(m.weight.float().std())
            with torch.no_grad():
                m.weight.add_(noise.to(m.weight.device, m.weight.dtype))


def record(hf_dir: str, batch: TrainBatch, num_layers: int, topk: int) -> torch.Tensor:
    actor = build(hf_dir, LAYOUTS["tp1"])
    start_logs(actor)
    actor.compute_logprobs(batch, temperature=1.0)
    routes, filled = placed(actor, num_layers, topk)
    assert bool((filled == 1).all()), "every (row, position, layer) routed exactly once"
    return routes


def differ(got: torch.Tensor, want: torch.Tensor, where: torch.Tensor) -> int:
    return int(((got != want).any(dim=-1) & where.unsqueeze(-1)).sum())


def lp_gap(logp: torch.Tensor, batch: TrainBatch) -> float | None:
    """Mean |Δ log-prob| against the rollout's over the response tokens (when it has them)."""
    if batch.rollout_logprobs is None:
        return None
    return float(((logp - batch.rollout_logprobs).abs() * batch.mask).sum() / batch.mask.sum())


def held_on_rank0(batch: TrainBatch, routes: torch.Tensor, valid: torch.Tensor) -> TrainBatch:
    """`batch` with `routes` [N, L, layers, topk] (valid on a prefix of each row) as a training run
    holds them: compact, the arrays on rank 0 only, every other rank knowing their shapes."""
    arrays = []
    for row, flags in zip(routes, valid):
        n = int(flags.sum())
        assert bool(flags[:n].all()), "recorded routes cover a prefix of each row"
        arrays.append(row[:n].numpy())
    group = RolloutGroup(0, {}, [Sample([], [], [], routed_experts=a) for a in arrays])
    sent = hold_on_rank0([group])[0]                      # what the broadcast carries
    samples = group.samples if dist.get_rank() == 0 else sent.samples
    return dataclasses.replace(batch, routes=RouteRows.of_samples([s.routed_experts for s in samples],
                                                                  int(routes.shape[1])))


def held_samples(batch: TrainBatch) -> list[list[int]]:
    """The samples whose routes each rank holds now."""
    assert batch.routes is not None
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(batch.routes.store.arrays))
    return every


def run_layout(hf_dir: str, name: str, batch: TrainBatch, recorded: torch.Tensor, valid: torch.Tensor) -> dict:
    assert batch.routes is not None
    # Compared as sets: vLLM's CPU router does not sort a token's ids (and `placed` sorts).
    routes = recorded.long().sort(dim=-1).values
    num_layers, topk = routes.shape[2], routes.shape[3]
    actor = build(hf_dir, LAYOUTS[name])
    res: dict = {}
    for mode, replay in (("same_weights_no_replay", False), ("same_weights_replay", True)):
        logp = actor.compute_logprobs(batch, temperature=1.0, replay=replay)
        res[mode] = {"metric": actor.routing_metrics, "lp_gap": lp_gap(logp, batch)}
        if mode == "same_weights_no_replay":
            res["held"] = held_samples(batch)
    perturb_routers(actor, scale=3.0)
    for mode, replay in (("no_replay", False), ("replay", True)):
        start_logs(actor)
        old = actor.compute_logprobs(batch, temperature=1.0, replay=replay)
        got, filled = placed(actor, num_layers, topk)
        res[mode] = {"differ_valid": differ(got, routes, valid), "metric": actor.routing_metrics,
                     "filled_once": bool((filled == 1).all()), "logprob_sum": float(old.sum())}
        if mode == "no_replay":
            live = got
        else:
            # Tokens without a route are routed live; at the first layer the router's input does not
            # depend on replay, so they equal the unreplayed forward's choice there.
            res[mode]["invalid_first_layer_differ_live"] = differ(got[:, :, :1], live[:, :, :1], ~valid)
            res[mode]["invalid_first_layer_differ_recorded"] = differ(got[:, :, :1], routes[:, :, :1], ~valid)
    # Token-budget micro-batches (rows regrouped by length, cut to their longest) replay the same
    # routes: the same log-probs on the masked positions as the padded path.
    actor.max_tokens_per_microbatch = 2 * SHAPE["length"]
    budget = actor.compute_logprobs(batch, temperature=1.0, replay=True)
    actor.max_tokens_per_microbatch = None
    res["budget_replay_logprob_diff"] = float(((budget - old).abs() * batch.mask).max())
    batch = dataclasses.replace(batch, old_logprobs=old, ref_logprobs=old.clone())
    start_logs(actor)
    metrics = actor.train_step(batch, AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.28),
                               temperature=1.0, rl_step=0)
    recomputed = None
    if actor.config.recompute_granularity == "full":
        again, again_filled = placed(actor, num_layers, topk, recompute=True)
        recomputed = {"differ_valid": differ(again, routes, valid), "filled_once": bool((again_filled == 1).all())}
    got, filled = placed(actor, num_layers, topk)
    res["train_recompute"] = recomputed
    res["train"] = {"differ_valid": differ(got, routes, valid), "filled_once": bool((filled == 1).all()),
                    "metric": metrics.get("routing/mismatch_frac"), "loss": metrics["loss/total"]}
    res["valid_tokens"] = int(valid.sum()) * num_layers
    return res


def main() -> None:
    hf_dir, out = sys.argv[1], sys.argv[2]
    init_distributed()                      # the batch's routes are held by rank 0 (`held_on_rank0`)
    hf = read_hf_config(hf_dir)
    num_layers, topk = hf["num_hidden_layers"], hf["num_experts_per_tok"]
    if len(sys.argv) > 3:
        batch = torch.load(sys.argv[3], weights_only=False)
        assert batch.routes is not None and batch.routes.store.everywhere
        routes, valid = batch.routes.dense(batch.num_rows, int(batch.tokens.shape[1]))
    else:
        batch = make_batch(512, SHAPE["rows"], SHAPE["length"])
        routes = record(hf_dir, batch, num_layers, topk).to(torch.uint8)
        # Recorded like vLLM's: T − 1 rows per sequence (the last token is never forwarded); one
        # row also lost its routes after position 15 (e.g. a server-side cut).
        valid = torch.ones(SHAPE["rows"], SHAPE["length"], dtype=torch.bool)
        valid[:, -1] = False
        valid[3, 16:] = False
    # The actor gets each row's valid prefix; the reference keeps what was recorded beyond it too.
    batch = held_on_rank0(batch, routes, valid)
    SHAPE["rows"], SHAPE["length"] = batch.num_rows, int(batch.tokens.shape[1])
    assert batch.routes is not None
    result: dict = {"recorded_experts_used": sorted(set(routes.long().unique().tolist())),
                    "rows": batch.num_rows, "samples_with_routes": batch.routes.samples()}
    for name in LAYOUTS:
        result[name] = run_layout(hf_dir, name, batch, routes, valid)
    finish(result, out)


if __name__ == "__main__":
    main()
