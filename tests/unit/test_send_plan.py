"""The plan of who sends which part of the weights (`megatron_rl/send_plan.py`), over every
production recipe: each part (TP / expert-TP shard of a stage's HF tensors) has exactly one owner,
whose coordinates megatron-core's own `RankGenerator` agrees with; a node sender needs from other
nodes only what its own ranks do not own; and the NCCL engine is vLLM's nccl_m2n only where its
one-mesh layout can express the trainer, sparse_nccl with delta sync, else the broadcast."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from megatron_rl.config import load_recipe
from megatron_rl.send_plan import m2n_refusal, nccl_in_force, node_parts, parts, rank_coords, transport_plan
from megatron_rl.topology import recipe_shm_senders

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = sorted(p for p in (REPO / "recipes").glob("qwen3_*/*.yaml") if p.name != "base.yaml")
IDS = [f"{p.parent.name}/{p.stem}" for p in PRODUCTION]


def is_moe(cfg) -> bool:  # type: ignore[no-untyped-def]
    hf = json.loads((Path(cfg.model.hf_config) / "config.json").read_text())
    return int(hf.get("num_experts", 0)) > 0


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_coordinates_are_megatron_cores(recipe: Path) -> None:
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core.parallel_state import RankGenerator

    p = load_recipe(recipe).parallelism
    tp, pp, cp, ep, etp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                           p.expert_model_parallel_size, p.expert_tp)
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=p.data_parallel_size, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=p.world_size // (etp * ep * pp), pp=pp, cp=1, order=order)

    def index(gen: RankGenerator, token: str) -> dict[int, int]:
        return {rank: i for group in gen.get_ranks(token) for i, rank in enumerate(group)}

    want = {t: index(dense, t) for t in ("tp", "cp", "dp", "pp")}
    want_e = {t: index(expert, t) for t in ("tp", "ep", "dp")}
    for c in rank_coords(p):
        assert (c.tp, c.cp, c.dp, c.pp) == tuple(want[t][c.rank] for t in ("tp", "cp", "dp", "pp"))
        assert (c.etp, c.ep, c.edp) == tuple(want_e[t][c.rank] for t in ("tp", "ep", "dp"))
        assert c.node == c.rank // p.gpus_per_node


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_every_part_has_one_owner_that_holds_it(recipe: Path) -> None:
    cfg = load_recipe(recipe)
    p, moe = cfg.parallelism, is_moe(cfg)
    every = parts(p, moe)
    keys = Counter((x.kind, x.stage, x.shard, x.expert_rank) for x in every)
    assert max(keys.values()) == 1, "a part owned twice would be sent twice"
    coords = {c.rank: c for c in rank_coords(p)}
    pp, tp = p.pipeline_model_parallel_size, p.tensor_model_parallel_size
    assert sum(k[0] == "dense" for k in keys) == pp * tp
    assert sum(k[0] == "replicated" for k in keys) == pp
    expected_expert = pp * p.expert_tp * p.expert_model_parallel_size if moe else 0
    assert sum(k[0] == "expert" for k in keys) == expected_expert
    for x in every:
        c = coords[x.owner]
        assert c.pp == x.stage and c.node == x.node
        if x.kind == "expert":
            assert (c.etp, c.ep, c.edp) == (x.shard, x.expert_rank, 0)
        else:
            assert (c.tp, c.cp, c.dp) == (x.shard, 0, 0)
    # Owners spread over the nodes: with EP across nodes, no gather to one node for the experts.
    if moe and p.expert_model_parallel_size * p.expert_tp >= p.gpus_per_node * p.nodes:
        assert {x.node for x in every if x.kind == "expert"} == set(range(p.nodes))


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_node_senders_fetch_only_what_other_nodes_own(recipe: Path) -> None:
    cfg = load_recipe(recipe)
    p, moe = cfg.parallelism, is_moe(cfg)
    nodes = list(range(p.nodes))
    every = set(parts(p, moe))
    for n in node_parts(p, moe, nodes):
        assert set(n.local) | set(n.remote) == every and not set(n.local) & set(n.remote)
        assert all(x.node == n.node for x in n.local) and all(x.node != n.node for x in n.remote)
    assert sum(len(n.local) for n in node_parts(p, moe, nodes)) == len(every)


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_engine_of_each_transport(recipe: Path) -> None:
    cfg = load_recipe(recipe)
    moe = is_moe(cfg)
    senders = [s.rank for s in recipe_shm_senders(cfg)]
    plan = transport_plan(cfg, moe, senders, delta=False, m2n=True)
    if cfg.rollout.weight_transfer == "shm":
        assert plan.engine == "mrl_shm" and plan.gather and list(plan.senders) == senders
    nccl = cfg.__class__.__new__(cfg.__class__)
    nccl.__dict__.update(cfg.__dict__)
    nccl.rollout = cfg.rollout.__class__(**{**cfg.rollout.__dict__, "weight_transfer": "nccl"})
    why = m2n_refusal(nccl, moe)
    with_m2n = transport_plan(nccl, moe, senders, delta=False, m2n=True)
    without = transport_plan(nccl, moe, senders, delta=False, m2n=False)
    assert without.engine == "mrl_nccl" and without.senders == (0,) and without.gather
    if why is None:
        assert with_m2n.engine == "nccl_m2n" and not with_m2n.gather
        assert with_m2n.senders == tuple(range(nccl.parallelism.world_size))
        assert "not importable" in without.why
    else:
        assert with_m2n == transport_plan(nccl, moe, senders, delta=False, m2n=False) and why in with_m2n.why
    sparse = transport_plan(nccl, moe, senders, delta=True, m2n=True)
    assert sparse.engine == "mrl_nccl" and sparse.senders == (0,) and "sparse_nccl format" in sparse.why
    assert nccl_in_force(nccl, moe, m2n=True, delta=True) == sparse.why


def test_m2n_where_one_mesh_expresses_the_trainer() -> None:
    cfg = load_recipe(PRODUCTION[0])
    rollout = cfg.rollout.__class__(**{**cfg.rollout.__dict__, "weight_transfer": "nccl",
                                       "placement": "disaggregated"})
    par = cfg.parallelism.__class__(**{**cfg.parallelism.__dict__, "pipeline_model_parallel_size": 1,
                                       "expert_model_parallel_size": 1, "context_parallel_size": 1})
    cfg.rollout, cfg.parallelism = rollout, par
    assert m2n_refusal(cfg, moe=True) is None
    assert transport_plan(cfg, True, [0], delta=False, m2n=True).engine == "nccl_m2n"
    # ...but the run broadcasts from rank 0 (nccl_m2n is not driven yet), and its start-up line says so
    assert nccl_in_force(cfg, True, m2n=True).startswith("nccl: vLLM's broadcast from rank 0 (nccl_m2n would")
    assert "not importable" in nccl_in_force(cfg, True, m2n=False)
    cfg.parallelism = par.__class__(**{**par.__dict__, "expert_model_parallel_size": 8})
    assert "EP 8" in (m2n_refusal(cfg, moe=True) or "")
    cfg.parallelism = par.__class__(**{**par.__dict__, "pipeline_model_parallel_size": 2})
    assert "PP 2" in (m2n_refusal(cfg, moe=True) or "")
