"""The weight gather's plan (`megatron_rl/weights/gather_plan.py`), over every production layout.

Each layout's ranks get their coordinates from megatron-core's own `RankGenerator` (the one
`initialize_model_parallel` uses), each layer's tensors from the planner's parameter count. As in
`sharding.gather_to_rank0`, a rank cuts the layer's tensors of its first replica into runs of the
chunk size, and run i of every rank goes to rank 0 together; the ranks own their run's tensors
when they are TP (or expert-TP) rank 0 of the first replica.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_recipe
from megatron_rl.config.schema import ParallelismConfig
from megatron_rl.planner.memory import stage_layer_ranges
from megatron_rl.planner.params import Block, Shard, count_params
from megatron_rl.weights.gather_plan import Owned, Spec, plan_parts, rank0_peers, receives, runs, sends, spec_nbytes

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = sorted(p for p in (REPO / "recipes").glob("qwen3_*/*.yaml") if p.name != "base.yaml")
IDS = [f"{p.parent.name}/{p.stem}" for p in PRODUCTION]
CHUNK = 32 << 20          # = sharding.GATHER_CHUNK_BYTES (tests/unit/test_planner_host.py checks the twin)
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int
    stage: int
    expert_rank: int | None
    """The expert-parallel rank holding it; None for a dense (TP-sharded or replicated) tensor."""


@dataclass(frozen=True)
class Coords:
    tp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


def coordinates(p: ParallelismConfig) -> list[Coords]:
    """Each global rank's place in the dense and the expert grid, from megatron-core's generator."""
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"                 # initialize_model_parallel's default, which actor.py keeps
    tp, pp, ep, etp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                       p.expert_model_parallel_size, p.expert_tp)
    dense = RankGenerator(tp=tp, ep=1, dp=p.data_parallel_size, pp=pp, cp=p.context_parallel_size, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=p.world_size // (etp * ep * pp), pp=pp, cp=1, order=order)

    def index(gen: RankGenerator, token: str) -> dict[int, int]:
        return {rank: i for group in gen.get_ranks(token) for i, rank in enumerate(group)}

    d = {t: index(dense, t) for t in ("tp", "dp", "pp")}
    e = {t: index(expert, t) for t in ("tp", "ep", "dp")}
    return [Coords(d["tp"][r], d["dp"][r], d["pp"][r], e["tp"][r], e["ep"][r], e["dp"][r])
            for r in range(p.world_size)]


def layer_tensors(blocks: tuple[Block, ...], prefix: str, stage: int, experts: int, ep: int) -> list[Tensor]:
    """One tensor per dense block; an expert block as each expert's linear_fc1 (gate/up, 2/3 of it)
    and linear_fc2, on the EP rank holding the expert."""
    out = []
    for k, b in enumerate(blocks):
        if b.shard is not Shard.EXPERT:
            out.append(Tensor(f"{prefix}.{b.component}.{k}", b.params, stage, None))
            continue
        per = b.params // experts
        for j in range(experts):
            where = j // (experts // ep)
            out += [Tensor(f"{prefix}.{b.component}.{k}.{j}.linear_fc1", per * 2 // 3, stage, where),
                    Tensor(f"{prefix}.{b.component}.{k}.{j}.linear_fc2", per // 3, stage, where)]
    return out


def model_layers(recipe: Path) -> tuple[ParallelismConfig, int, list[list[Tensor]]]:
    """The recipe's layout, its model's parameter count, and the tensors of each layer in the
    gather's order (layers, then embedding/final norm/output/MTP as the `None` layer)."""
    cfg = load_recipe(recipe)
    p = cfg.parallelism
    params = count_params(json.loads((Path(cfg.model.hf_config) / "config.json").read_text()))
    e, ep, pp = params.dims.experts, p.expert_model_parallel_size, p.pipeline_model_parallel_size
    stages = stage_layer_ranges(len(params.layers), pp)
    layers = [layer_tensors(layer.blocks, f"decoder.layers.{i}", next(s for s, r in enumerate(stages) if i in r), e, ep)
              for i, layer in enumerate(params.layers)]
    layers.append(layer_tensors(params.pre, "pre", 0, e, ep) + layer_tensors(params.post, "post", pp - 1, e, ep))
    return p, params.total, layers


def holds(c: Coords, t: Tensor) -> bool:
    """In this rank's first-replica parameters (`LocalParam.in_first_replica`)."""
    if c.pp != t.stage:
        return False
    return c.edp == 0 and c.ep == t.expert_rank if t.expert_rank is not None else c.dp == 0


def owns(c: Coords, t: Tensor) -> bool:
    """`LocalParam.owns`: TP rank 0 (of the expert-TP group for an expert) of the first replica."""
    return holds(c, t) and (c.etp if t.expert_rank is not None else c.tp) == 0


def layer_plans(coords: list[Coords], tensors: list[Tensor]) -> list[list[list[Spec]]]:
    """`gather_to_rank0` for one layer: per round, rank 0's plan."""
    per_rank = [runs([t for t in tensors if holds(c, t)], lambda t: t.numel * BF16.itemsize, CHUNK) for c in coords]
    plans = []
    for i in range(max(len(r) for r in per_rank)):
        owned: list[list[Owned]] = [[(t.name, (t.numel,), BF16) for t in (r[i] if i < len(r) else []) if owns(c, t)]
                                    for c, r in zip(coords, per_rank, strict=True)]
        plan = plan_parts(owned, CHUNK)
        assert not isinstance(plan, str), plan
        plans.append(plan)
    return plans


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_every_tensor_reaches_rank0_once_from_its_owner_in_bounded_parts(recipe: Path) -> None:
    p, total_params, layers = model_layers(recipe)
    coords = coordinates(p)
    assert len(coords) == p.nodes * p.gpus_per_node and p.gpus_per_node == 8
    assert sum(t.numel for ts in layers for t in ts) == total_params       # the whole model, per the planner
    arrived: list[tuple[int, str]] = []
    received = 0
    peers: set[int] = set()
    for plan in (plan for ts in layers for plan in layer_plans(coords, ts)):
        for part in plan:
            assert len(part) == 1 or sum(map(spec_nbytes, part)) <= CHUNK, "rank 0 holds one part at a time"
            assert sends(part, 0) == [] and all(s[0] != 0 for s in receives(part))
            for rank in {s[0] for s in part} - {0}:
                # One batch per part: the rank's sends, in the order rank 0 posts its receives from it.
                assert sends(part, rank) == [s for s in receives(part) if s[0] == rank] != []
            arrived += [(s[0], s[1]) for s in part]
            received += sum(spec_nbytes(s) for s in receives(part))
        peers.update(rank0_peers(plan))
    owners = [(r, t.name) for ts in layers for t in ts for r, c in enumerate(coords) if owns(c, t)]
    assert len(owners) == len({n for _, n in owners}), "one owner per tensor"
    assert sorted(arrived) == sorted(owners), "each tensor once, from its owner"
    # Received bytes are the tensors' own (no padding): everything but what rank 0 owns.
    assert received == 2 * (total_params - sum(t.numel for ts in layers for t in ts if owns(coords[0], t)))
    # EP × ETP × PP = the world in every production layout, so every rank owns experts and rank 0
    # hears from all others: unbatched lazy-init send/recv would make it 63 2-rank communicators.
    assert sorted(peers) == list(range(1, len(coords)))


def test_plan_parts_cuts_in_rank_order_and_refuses_two_owners() -> None:
    mb = 1 << 20
    specs: list[list[Owned]] = [[("a", (mb,), BF16)], [("b", (3 * mb,), BF16), ("c", (mb,), BF16)], []]
    plan = plan_parts(specs, 4 * mb)
    # 2 MiB + 6 MiB > 4 MiB: b alone (bigger than a part), then c.
    assert plan == [[(0, "a", (mb,), BF16)], [(1, "b", (3 * mb,), BF16)], [(1, "c", (mb,), BF16)]]
    assert plan_parts(specs, 10 * mb) == [[(0, "a", (mb,), BF16), (1, "b", (3 * mb,), BF16), (1, "c", (mb,), BF16)]]
    assert rank0_peers(plan) == [1]
    clash = plan_parts([[("a", (1,), BF16)], [], [("a", (1,), BF16)]], mb)
    assert clash == "a is owned by ranks 0 and 2; `LocalParam.owns` must pick one"
