"""Who sends which part of the weights to whom in a weight sync, as pure functions of the layout
(CPU-tested over every production recipe, `tests/unit/test_send_plan.py`; `topology.py` style).

A part is one shard of the HF tensors of a pipeline stage: a TP shard of the dense tensors, an
expert-TP shard of one expert-parallel rank's experts, or the replicated tensors (norms, router).
Its owner is the rank of the first data-parallel replica that holds it; megatron-core 0.19 numbers
both grids in the order tp-cp-ep-dp-pp (`parallel_state.initialize_model_parallel`'s default):
dense rank = t + TP·(c + CP·(d + DP·p)), expert rank = e_t + ETP·(e + EP·(d_e + DP_e·p)).

What each transport does with the plan (`transport_plan`):

- `shm`, one sender: global rank 0 gathers every part (`weights/sharding.gather_to_rank0`) and
  writes it once for every server.
- `shm`, a sender per node (colocated over several nodes, `sync/nodes.py`): each node's sender
  needs every part (its node's server holds the whole model); the parts its own node's ranks own
  need no gather across nodes, only the others do (`node_parts`).
- `nccl`: vLLM's `nccl_m2n` (every trainer rank sends its own shard into the servers' layout, no
  gather) where nccl-extensions is importable and the layout is one m2n can express (`m2n_refusal`),
  else vLLM's broadcast from rank 0 after the gather; with delta sync, the owners' patches are
  gathered to rank 0 and broadcast in vLLM's `sparse_nccl` format (rank 0 the only sender, as in
  sparse_nccl_engine.py's `SparseNCCLTrainerWeightTransferEngine`), between whole rounds: the
  servers' `mrl_nccl` engine takes both (`rollout/engines/gpu.py`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .config.schema import ParallelismConfig, RecipeConfig

Kind = Literal["dense", "replicated", "expert"]


@dataclass(frozen=True)
class Coords:
    """One global rank's place in the dense grid and in the expert grid."""

    rank: int
    node: int
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


def rank_coords(p: ParallelismConfig) -> list[Coords]:
    """Every global rank's coordinates (torchrun places a node's ranks contiguously)."""
    tp, cp, pp, ep, etp = (p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                           p.expert_model_parallel_size, p.expert_tp)
    world = p.world_size
    if world % (tp * cp * pp) or world % (etp * ep * pp):
        raise ValueError(f"world size {world} does not split into TP {tp} × CP {cp} × PP {pp} "
                         f"nor into ETP {etp} × EP {ep} × PP {pp}")
    dp, edp = world // (tp * cp * pp), world // (etp * ep * pp)
    out = []
    for r in range(world):
        t, rest = r % tp, r // tp
        c, rest = rest % cp, rest // cp
        d, s = rest % dp, rest // dp
        et, rest = r % etp, r // etp
        e, rest = rest % ep, rest // ep
        ed = rest % edp
        out.append(Coords(r, r // p.gpus_per_node, t, c, d, s, et, e, ed))
    return out


@dataclass(frozen=True)
class Part:
    kind: Kind
    stage: int
    shard: int
    """TP rank (dense), expert-TP rank (expert), 0 (replicated)."""
    expert_rank: int | None
    """The EP rank whose experts these are (experts e with e // (experts / EP) = expert_rank)."""
    owner: int
    node: int


def parts(p: ParallelismConfig, moe: bool) -> list[Part]:
    """Every part of the model, each with the one rank that owns (holds and sends) it."""
    coords = rank_coords(p)
    out = []
    for c in coords:
        if c.cp == 0 and c.dp == 0:
            out.append(Part("dense", c.pp, c.tp, None, c.rank, c.node))
            if c.tp == 0:
                out.append(Part("replicated", c.pp, 0, None, c.rank, c.node))
        if moe and c.edp == 0:
            out.append(Part("expert", c.pp, c.etp, c.ep, c.rank, c.node))
    return out


@dataclass(frozen=True)
class NodeParts:
    """What one node sender of `sync/nodes.py` needs, and from where."""

    node: int
    local: tuple[Part, ...]
    """Owned by ranks of its own node: NVLink / host, no inter-node gather."""
    remote: tuple[Part, ...]
    """Owned by ranks of other nodes: those come over the interconnect, from their owners."""


def node_parts(p: ParallelismConfig, moe: bool, nodes: Sequence[int]) -> list[NodeParts]:
    """Per sender node, its own node's parts and the others' (every node's server needs all)."""
    every = parts(p, moe)
    return [NodeParts(n, tuple(x for x in every if x.node == n), tuple(x for x in every if x.node != n))
            for n in nodes]


def m2n_importable() -> bool:
    """NVIDIA's nccl-extensions (`nccl.m2n`, what vLLM's nccl_m2n engine imports,
    weight_transfer/m2n_common.py `import_m2n`) is installed."""
    try:
        return importlib.util.find_spec("nccl.m2n") is not None
    except ModuleNotFoundError:
        return False


M2N_MAX_SOURCE_SHARDS = 16
"""vLLM 0.32.0 weight_transfer/m2n_common.py MAX_SOURCE_SHARDS (m2n's reshard_limits.h)."""


def m2n_refusal(cfg: RecipeConfig, moe: bool) -> str | None:
    """Why vLLM's nccl_m2n cannot carry this layout's weights, or None. m2n describes the trainer
    as ONE 2-axis mesh over all its ranks [0, T), each tensor sharded along at most one axis and
    replicated along the other (m2n_common.py `check_placements`, m2n_source.py `mesh_from_tensor`):
    a tensor held by a subset of the ranks (one pipeline stage; the experts of one EP rank, each
    its own HF tensor) is not expressible, and every trainer rank and server worker joins one
    communicator, so no GPU may hold both (NCCL: "Duplicate GPU detected")."""
    p = cfg.parallelism
    if cfg.rollout.placement != "disaggregated":
        return "the servers share the trainer's GPUs, and every trainer rank joins nccl_m2n's communicator"
    if p.pipeline_model_parallel_size > 1:
        return f"pipeline stages (PP {p.pipeline_model_parallel_size}) hold their layers on a subset of the ranks"
    if moe and p.expert_model_parallel_size > 1:
        return (f"each expert (an HF tensor of its own) is held by 1/{p.expert_model_parallel_size} of the ranks "
                f"(EP {p.expert_model_parallel_size})")
    if p.context_parallel_size > 1:
        return "context parallelism adds a third mesh axis"
    if p.tensor_model_parallel_size > M2N_MAX_SOURCE_SHARDS:
        return f"TP {p.tensor_model_parallel_size} > m2n's {M2N_MAX_SOURCE_SHARDS} source shards"
    return None


Engine = Literal["mrl_shm", "mrl_nccl", "nccl_m2n", "mrl_ipc"]


@dataclass(frozen=True)
class TransportPlan:
    engine: Engine
    """The servers' weight-transfer engine (`--weight-transfer-config`)."""
    gather: bool
    """Every part is gathered to global rank 0 first."""
    senders: tuple[int, ...]
    """The global ranks that send to the servers (or write their segments)."""
    why: str
    """One line for the start-up log: what is used, and why not the alternative."""


def transport_plan(cfg: RecipeConfig, moe: bool, senders: Sequence[int], delta: bool,
                   m2n: bool | None = None) -> TransportPlan:
    """The plan of `rollout.weight_transfer` for `cfg`. `senders`: the `shm` node senders'
    ranks (`topology.recipe_shm_senders`); `delta`: the syncs may be deltas (`rollout.sync_delta`
    not 'off'); `m2n`: nccl-extensions importable (default: looked up here)."""
    backend = cfg.rollout.weight_transfer
    world = cfg.parallelism.world_size
    if backend == "shm":
        many = len(senders) > 1
        return TransportPlan("mrl_shm", True, tuple(senders),
                             f"shm: {'a sender per node' if many else 'rank 0'} writes every part, gathered to rank 0")
    if backend == "ipc":
        return TransportPlan("mrl_ipc", True, (0,), "ipc: rank 0 copies every gathered part to the servers' GPUs")
    if delta:
        return TransportPlan("mrl_nccl", True, (0,),
                             "nccl with delta sync: the owners' patches, gathered to rank 0 and broadcast in vLLM's "
                             "sparse_nccl format and patched in place (the servers on vLLM's Triton MoE kernels), a "
                             "whole broadcast every rollout.sync_dense_every syncs (not nccl_m2n: it sends whole "
                             "tensors)")
    why = m2n_refusal(cfg, moe)
    if m2n is None:
        m2n = m2n_importable()
    if why is None and m2n:
        return TransportPlan("nccl_m2n", False, tuple(range(world)),
                             "nccl: vLLM's nccl_m2n (nccl-extensions found): every rank sends its own shard, no gather")
    reason = "nccl-extensions (nccl.m2n) is not importable" if why is None else why
    return TransportPlan("mrl_nccl", True, (0,), f"nccl: vLLM's broadcast from rank 0 (not nccl_m2n: {reason})")


def nccl_in_force(cfg: RecipeConfig, moe: bool, m2n: bool | None = None, delta: bool = False) -> str:
    """The start-up line of a `rollout.weight_transfer: nccl` run: what megatron-rl sends with
    today — vLLM's broadcast from rank 0 (`sync/gpu.py`), with `delta` its sparse rounds, whatever
    `transport_plan` would choose — and why not nccl_m2n, which is planned here and not yet driven
    (GPU audit 5 #7: the line must not claim a transfer the run does not make)."""
    plan = transport_plan(cfg, moe, [0], delta=delta, m2n=m2n)
    if plan.engine == "mrl_nccl":
        return plan.why
    return ("nccl: vLLM's broadcast from rank 0 (nccl_m2n would carry this layout and nccl-extensions is "
            "installed, but megatron-rl does not drive nccl_m2n yet)")
