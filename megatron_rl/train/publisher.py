"""The weights the rollout servers hold, with one owner: `WeightPublisher` builds the transports
and each server's link, sends every version, and proves the servers hold it (the log-prob gate,
calibrated at start-up, and after a failed gate the checksum diagnosis).

`RolloutFleet` (`fleet.py`) owns the servers and knows nothing of `sync/`; the publisher reads
the fleet's servers, clients and supervisors, and hands the fleet its links to supervise (a
restarted server is brought back through its link). Everything that says which weights the servers
hold lives here: the `version`, the probe and gate, the failed-gate count, and QLoRA's first full
sync (the whole dequantized base once, then only the adapted tensors). Methods that say so are
collective.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.schema import RecipeConfig
from ..megatron.devices import compute_device, from_rank0, wait_for_rank0
from ..rollout.client import RolloutClient
from ..rollout.supervisor import ProbeExpectation, ServerLink, ServerSupervisor
from ..send_plan import nccl_in_force
from ..sync import OwnerSender, SyncReport, Transport, make_transport
from ..sync import verify as verification
from ..sync.checker import check_servers
from ..sync.diagnose import CHECKER_DEADLINE_S, Diagnosis, diagnose_sync
from ..sync.lora import sync_actor
from ..sync.network import NetworkCopyTransport, open_copy_group, receivers_beside
from ..sync.nodes import NodeReceiver, NodeShmTransport, open_sender_group
from ..sync.shm import ShmLink
from ..topology import ShmSender, shm_senders
from ..types import TrainBatch
from .fleet import RolloutFleet, node_position
from .policy import Policy
from .run import Stop


def overlaps_verification(cfg: RecipeConfig, dtype: torch.dtype) -> bool:
    """Whether a sync's verification may run while the next rollout generates (`WeightPublisher.check`
    gates the step's training on it): the synchronous loop (one version per step), servers that do
    not sleep after the rollout (a probe request in flight when they sleep), and fp32, whose gate
    bounds are absolute; bf16's bounds are calibrated on a probe scored alone, and one batched with
    generation may run other kernels."""
    r = cfg.rollout
    return r.max_staleness == 0 and r.sleep_level is None and dtype == torch.float32


@dataclass
class PendingCheck:
    """A synced version whose verification runs while the next rollout generates."""

    version: int
    server_diffs: Future[torch.Tensor] | None
    """Rank 0: server minus trainer log-probs of the probe, in a thread; None on other ranks."""


class WeightPublisher:
    """The actor's weights on every server of `fleet`: transports, links, version, probe and gate."""

    def __init__(self, cfg: RecipeConfig, fleet: RolloutFleet) -> None:
        self.cfg, self.fleet = cfg, fleet
        self.rank0 = fleet.rank0
        self.transport: Transport | None = None
        """Rank 0's; with a node sender per node (`sync/nodes.py`) also each other sender's."""
        self.links: list[ServerLink] = []
        """Per server (rank 0), what its supervisor re-sends through and wraps each round with."""
        self.node_sender: NodeReceiver | None = None
        self.version = 0
        """The weights the servers hold (after `start`: the first sync's)."""
        self.probe: TrainBatch | None = None
        self.gate: verification.Gate | None = None
        """The verification probe and the gate calibrated on it at start-up (`start`)."""
        self.intact_misses = 0
        """Failed verification gates in a row whose diagnosis found every tensor intact."""
        self.base_sent = False
        """QLoRA: the first sync, which sends every tensor (the NF4 base dequantized), is done."""
        self.pending: PendingCheck | None = None
        """The last sync's verification, started by `publish(overlap=True)`, judged by `check`."""
        self.verified: dict[str, float] = {}
        """The metrics of the latest verification judged (the start-up one's first)."""
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ transports
    def open(self) -> None:
        """Collective, after `fleet.start`. Build the transports and each server's link, and hand
        the links to the fleet's supervisors (before any sync: a round is redone under them). Where
        the owners of the weights compare them for delta syncs (`sync/owners.py`), every other rank
        gets a transport holding its part's copy."""
        self._open()
        owners = getattr(self.transport, "owners", None) if self.rank0 else None
        whole = from_rank0(None if owners is None else owners.whole_past_break_even)   # collective: every rank
        if whole is not None and not self.rank0:                # as rank 0's own part of the comparison
            self.transport = OwnerSender(whole_past_break_even=whole)

    def _open(self) -> None:
        r = self.cfg.rollout
        senders = self._shm_senders() if r.weight_transfer == "shm" else []
        group = open_sender_group(senders, self.cfg.trainer.collective_timeout_min)   # collective: every rank
        if group is not None and not self.rank0:
            if dist.get_rank() in [s.rank for s in senders]:
                self.node_sender = NodeReceiver(group, r.sync_bucket_mb << 20, compute_device())
                self.transport = self.node_sender
        if not self.rank0:
            return
        servers = self.fleet.servers
        if group is not None:
            if r.sync_delta == "on":
                raise ValueError("rollout.sync_delta: 'on' is not supported with a sender per node (colocated "
                                 "over several nodes) yet; use 'auto' (dense there) or 'off'")
            # Colocated over several nodes: each node's first rank writes its node's /dev/shm copy.
            node_transport = NodeShmTransport(servers, senders, group, segment_bytes=r.sync_bucket_mb << 20,
                                              device=compute_device())
            self.transport, self.links = node_transport, list(node_transport.links)
            print(f"[rollout] weight sync: a sender per node, ranks {', '.join(str(s.rank) for s in senders)}, "
                  "each into its node's /dev/shm", flush=True)
        elif self._over_network():
            self.transport, self.links = self._network_transport()
        else:
            # One sender for all servers (write once / one broadcast); per server, what its
            # supervisor re-sends. A lone server on this node reads /dev/shm; servers on rollout
            # nodes without receivers read the shared run dir.
            lone = len(servers) == 1 and servers[0] is self.fleet.own_server
            sync_root = None if lone else self.fleet.run_dir / "rollout" / "sync"
            delta = "off" if r.sleep_level == 2 else r.sync_delta       # the wake-up leaves no weights to patch
            self.transport, self.links = make_transport(r.weight_transfer, servers, sync_root,
                                                        r.sync_bucket_mb << 20, delta=delta,
                                                        dense_every=r.sync_dense_every)
            if r.weight_transfer == "nccl":     # the engine in force, and why not nccl_m2n (send_plan.py);
                # `moe` only matters at EP > 1, which only an MoE model has
                print(f"[rollout] weight sync: {nccl_in_force(self.cfg, True, delta=delta != 'off')}", flush=True)
        if self.cfg.lora.base_quantization != "none":
            for link in self.links:
                if isinstance(link, ShmLink):
                    link.deltas_after_first = True
        self.fleet.supervise(self.links)

    def _over_network(self) -> bool:
        """Rank 0: the external servers' nodes run weight-copy receivers (`rollout-server --weight-copy`)."""
        if self.cfg.rollout.weight_transfer != "shm" or not self.fleet.external:
            return False
        try:
            return receivers_beside([Path(s.run_dir) for s in self.fleet.servers])
        except ValueError as exc:
            raise Stop(str(exc)) from exc

    def _network_transport(self) -> tuple[NetworkCopyTransport, list[ServerLink]]:
        """Every version over the network into each rollout node's /dev/shm (`sync/network.py`)."""
        r, servers = self.cfg.rollout, self.fleet.servers
        assert self.fleet.external is not None
        timeout_s = self.cfg.trainer.collective_timeout_min * 60
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        group = open_copy_group(Path(self.fleet.external), [Path(s.run_dir) for s in servers], host, timeout_s,
                                compute_device())
        delta = "off" if r.sleep_level == 2 else r.sync_delta
        transport = NetworkCopyTransport(servers, group, segment_bytes=r.sync_bucket_mb << 20, delta=delta,
                                         dense_every=r.sync_dense_every)
        print(f"[rollout] weight sync: over the network ({'NCCL' if group.nccl is not None else 'gloo'}) into each "
              f"of the {len(servers)} rollout nodes' /dev/shm (rollout.sync_delta {delta})", flush=True)
        return transport, list(transport.links)

    def _shm_senders(self) -> list[ShmSender]:
        """`topology.shm_senders` of this job as torchrun started it (the same on every rank)."""
        pos = node_position()
        external = self.fleet.external
        servers = pos.nodes if not external else max(1, len(self.fleet.servers))
        return shm_senders(not external, pos.nodes, dist.get_world_size() // pos.nodes, servers)

    def close(self) -> None:
        """The links (their segments) and this node's copy; a link that raises does not skip the
        later ones, and its error still surfaces. `RolloutFleet.close` calls this before it stops
        the servers, once the supervisors no longer restart them."""
        with ExitStack() as steps:               # runs its callbacks last-in first-out
            if self.node_sender is not None:                 # this node's copy of the weights
                steps.callback(self.node_sender.close)
            if isinstance(self.transport, NetworkCopyTransport):   # the receivers keep theirs till then
                steps.callback(self.transport.close)
            for link in reversed(self.links):
                steps.callback(link.close)
            if self._pool is not None:
                steps.callback(self._pool.shutdown, wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ versions
    def start(self, policy: Policy, forced: TrainBatch, seq_len: int, pad: int,
              resumed_version: int | None) -> dict[str, float]:
        """Collective. The first sync and the gate's calibration, in the order the servers' load
        allows; returns the start-up metrics. A resumed run re-sends its checkpointed weights under
        their own version; a new run's first sync is version 1."""
        self.version = resumed_version if resumed_version is not None else 1
        if policy.matches_server_load(resumed_version is not None):
            # The noise floor on the servers' own load of the checkpoint; the first sync is gated.
            self.probe, self.gate, first = self.calibrate(policy, forced, 0, seq_len, pad)
            self.push(policy, self.version)
            first.update(self.verify(policy, self.probe, self.version, self.gate))
        else:
            self.push(policy, self.version)
            self.probe, self.gate, first = self.calibrate(policy, forced, self.version, seq_len, pad)
        self.verified = {k: v for k, v in first.items() if k.endswith("_abs_diff")}
        return first

    def publish(self, policy: Policy, overlap: bool = False) -> dict[str, float]:
        """Collective. The updated weights to the woken servers as the next version, verified every
        `rollout.verify_every` versions; returns the sync/* metrics. With `overlap` the verification
        is only started (the server scores the probe while the next rollout generates): `check`
        judges it, and the step must call `check` before it trains on that rollout."""
        assert self.probe is not None and self.gate is not None, "start() comes before the first publish"
        assert self.pending is None, "a started verification is judged (check) before the next sync"
        self.version += 1
        self.fleet.wake()
        metrics = sync_metrics(self.push(policy, self.version))
        every = self.cfg.rollout.verify_every
        if every and self.version % every == 0:
            if overlap:
                self.pending = self._start_verify(policy, self.probe, self.version, self.gate)
            else:
                metrics.update(self.verify(policy, self.probe, self.version, self.gate))
        return metrics

    def _start_verify(self, policy: Policy, probe: TrainBatch, version: int,
                      gate: verification.Gate) -> PendingCheck:
        """Collective: the trainer's probe log-probs now; on rank 0 the servers' in a thread."""
        trainer_lp = policy.actor.compute_logprobs(probe, temperature=1.0)
        if not self.rank0:
            return PendingCheck(version, None)
        clients = self._supervised_clients(trainer_lp, probe, version, gate.limits)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
        return PendingCheck(version, self._pool.submit(verification.server_diffs, trainer_lp, probe, clients))

    def check(self, policy: Policy) -> dict[str, float]:
        """Collective, before a step trains on its rollout: the verification `publish(overlap=True)`
        started, judged as `verify` judges it (a failure raises `Stop` here, before any update uses
        the samples of those weights). Returns the metrics of the verification of the weights the
        rollout was generated on (with nothing pending, the latest one's, the start-up's at first)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return dict(self.verified)
        assert self.gate is not None
        return self.judge(policy, self._pending_stats(pending), pending.version, self.gate)

    def _pending_stats(self, pending: PendingCheck) -> torch.Tensor:
        """`diff_stats` of a started verification's server minus trainer log-probs (collective;
        every rank gets them; rank 0 waits for its thread)."""
        stats = torch.zeros(len(verification.STATS), dtype=torch.float64)
        if pending.server_diffs is not None:
            stats = verification.diff_stats(pending.server_diffs.result())
        dist.broadcast(stats, src=0)                         # a CPU tensor: gloo, also on GPU runs
        return stats

    def push(self, policy: Policy, version: int) -> SyncReport | None:
        """Send the actor's weights to the servers as `version` (collective; rank 0 gets the report)."""
        # Rank 0 may have spent minutes starting the server or generating: wait for it on the CPU,
        # not inside the NCCL collectives of the gather.
        wait_for_rank0()
        report = self._send(policy, self.transport, version)
        self.base_sent = True          # set only once a sync succeeded: a failed first one is redone whole
        return report

    def _send(self, policy: Policy, transport: Transport | None, version: int) -> SyncReport | None:
        # QLoRA's first sync sends every tensor: the server starts from the original base, the
        # trainer's policy is the base's NF4 image, and the gate must compare the same model.
        whole = policy.actor.quantization is not None and not self.base_sent
        return sync_actor(policy.actor, policy.adapter, transport, version, policy.dtype, whole=whole)

    # ------------------------------------------------------------------ proof
    def calibrate(self, policy: Policy, forced: TrainBatch, version: int, seq_len: int,
                  pad: int) -> tuple[TrainBatch, verification.Gate, dict[str, float]]:
        """The start-up measurement of the gate (collective): the server samples a completion of each
        forced-probe prompt; with the same weights on both sides (`version`), |Δ| on those sampled
        tokens is the kernel noise floor the later syncs are gated against (`verification.calibrate`).
        Returns (the probe of every later verification, the gate, the start-up metrics)."""
        sampled = None
        if self.rank0:
            fleet = self.fleet
            prompts = [row[:int(m.nonzero().min()) + 1].tolist() for row, m in zip(forced.tokens, forced.mask)]
            r = self.cfg.rollout
            settings = replace(r, n=1, temperature=1.0, top_p=1.0, top_k=-1,
                               max_response_length=min(verification.PROBE_TOKENS, r.max_response_length))
            samples = fleet.supervisors[0].call("the verification probe", fleet.clients[0].generate, prompts, settings)
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
        return self.judge(policy, self._probe_stats(policy, probe, version, gate.limits), version, gate)

    def judge(self, policy: Policy, stats: torch.Tensor, version: int, gate: verification.Gate) -> dict[str, float]:
        """Collective: `stats` of `version`'s probe through the gate; the metrics, or `Stop`."""
        problem = verification.failure(stats, gate.limits)
        if not problem:
            self.intact_misses = 0
            self.check_replicas(version)
            self.verified = verification.as_metrics(stats)
            return dict(self.verified)
        floor = dict(zip(verification.STATS, gate.floor))
        said = (f"weight-sync verification failed at version {version} ({policy.dtype}): {problem} "
                "(server and trainer disagree; the start-up noise floor was mean "
                f"{floor.get('mean', float('nan')):.3g}, p90 {floor.get('p90', float('nan')):.3g}). ")
        diagnosis = self.diagnose(policy, version)      # rank 0's, on every rank: all decide alike
        self.intact_misses = misses_after_failed_gate(diagnosis, self.intact_misses)
        in_row = self.cfg.rollout.verify_failures_in_row
        if self.intact_misses == 0 or self.intact_misses >= in_row:
            raise Stop(said + diagnosis.message() + (f" ({self.intact_misses} failed gates in a row with every "
                                                      "tensor intact)" if self.intact_misses else ""))
        if self.rank0:
            print(f"[sync] warning: {said}{diagnosis.message()}; training goes on ({self.intact_misses} of "
                  f"{in_row} such failures in a row stop the run: rollout.verify_failures_in_row)", flush=True)
        self.verified = {**verification.as_metrics(stats), "sync/verify_intact_misses": float(self.intact_misses)}
        return dict(self.verified)

    def check_replicas(self, version: int) -> None:
        """Collective, after a verified sync: vLLM's /weight_checker on every DP engine of every
        server must agree (`sync/checker.py`); one that differs stops the run, named. Nothing to
        compare with one server of one DP engine."""
        problem = None
        if self.rank0 and len(self.fleet.servers) * self.cfg.rollout.data_parallel_size > 1:
            problem = check_servers(self.fleet.servers, CHECKER_DEADLINE_S,
                                    [s.call for s in self.fleet.supervisors]).message(version)
        problem = from_rank0(problem)
        if problem is not None:
            raise Stop(problem)

    def diagnose(self, policy: Policy, version: int) -> Diagnosis:
        """Collective, after a failed verification only: which tensors reached the servers other than
        they were sent, re-sent once with both sides checksumming (`sync/diagnose.py`)."""
        wait_for_rank0()

        def resend(transport: Transport | None) -> Any:
            return self._send(policy, transport, version)

        return diagnose_sync(resend, self.transport, self.fleet.servers if self.rank0 else [])

    def _probe_stats(self, policy: Policy, probe: TrainBatch, version: int,
                     limits: verification.Limits) -> torch.Tensor:
        """`diff_stats` of server minus trainer over every server (collective; every rank gets them)."""
        trainer_lp = policy.actor.compute_logprobs(probe, temperature=1.0)      # on the CPU
        diffs: Future[torch.Tensor] | None = None
        if self.rank0:
            clients = self._supervised_clients(trainer_lp, probe, version, limits)
            diffs = Future()
            diffs.set_result(verification.server_diffs(trainer_lp, probe, clients))
        return self._pending_stats(PendingCheck(version, diffs))       # the same broadcast as an overlapped one

    def _supervised_clients(self, trainer_lp: torch.Tensor, probe: TrainBatch, version: int,
                            limits: verification.Limits) -> list[_Supervised]:
        """Rank 0: every server's client through its supervisor, which checks a restarted server
        against the trainer's probe log-probs of `version`."""
        seqs = verification.probe_sequences(probe)
        # What a restarted server is checked against (max |Δ|: a server restarted with other
        # weights is off by O(1); bf16 has no max bound of its own, so 10× its p90 bound).
        expected = ProbeExpectation(version, seqs, [
            [float(trainer_lp[i, j]) if probe.mask[i, j] > 0 else None for j in range(len(seq) - 1)]
            for i, seq in enumerate(seqs)], limits.max if limits.max is not None else 10 * limits.p90)
        clients = []
        for client, supervisor in zip(self.fleet.clients, self.fleet.supervisors):     # every server must agree
            supervisor.expected = expected
            clients.append(_Supervised(client, supervisor))
        return clients


def misses_after_failed_gate(diagnosis: Diagnosis, misses: int) -> int:
    """After a failed gate: the count of such failures in a row whose diagnosis proved every tensor
    intact (byte-identical on every worker, and the servers' /weight_checker unchanged by the
    re-send), or 0 when it did not (a tensor differs, or the diagnosis itself failed): then the
    failure is a broken transfer or load, and the run stops at once."""
    intact = diagnosis.error is None and bool(diagnosis.workers) and not diagnosis.differ and not diagnosis.reloaded
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
