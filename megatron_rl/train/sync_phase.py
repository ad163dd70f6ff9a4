"""Weight sync and its verification: the actor's weights go to every rollout server under a
version, and the servers' log-probs of a fixed probe batch must match the trainer's."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..megatron.devices import wait_for_rank0
from ..rollout.client import RolloutClient
from ..rollout.supervisor import ProbeExpectation, ServerSupervisor
from ..types import TrainBatch
from ..weights.sync import SyncReport
from . import lora_run, verification
from .run_control import Stop


def push_weights(session: Any, version: int) -> SyncReport | None:
    """Send the actor's weights to the servers as `version` (collective; rank 0 gets the report)."""
    # Rank 0 may have spent minutes starting the server or generating: wait for it on the CPU,
    # not inside the NCCL collectives of the gather.
    wait_for_rank0()
    return lora_run.sync(session.actor, session.adapter, session.transport, version, session.dtype)


def sync_metrics(report: SyncReport | None) -> dict[str, float]:
    if report is None:
        return {}
    return {"sync/seconds": report.seconds, "sync/mb": report.bytes / 2**20, "sync/parts": report.parts}


def verify(session: Any, probe: TrainBatch, version: int) -> dict[str, float]:
    """Server log-probs of fixed sequences vs the trainer's own (T = 1): statistics of |Δ| over
    the probe's response tokens, gated by the bounds of the weights' dtype (`verification`).
    Collective: every rank returns the metrics or raises `Stop`."""
    trainer_lp = session.actor.compute_logprobs(probe, temperature=1.0)      # on the CPU
    stats = torch.zeros(len(verification.STATS), dtype=torch.float64)
    limits = verification.limits_for(session.dtype, session.cfg.rollout.verify_tolerance)
    if session.rank0:
        seqs = verification.probe_sequences(probe)
        # What a restarted server is checked against (max |Δ|: a server restarted with other
        # weights is off by O(1); bf16 has no max bound of its own, so 10× its p90 bound).
        expected = ProbeExpectation(version, seqs, [
            [float(trainer_lp[i, j]) if probe.mask[i, j] > 0 else None for j in range(len(seq) - 1)]
            for i, seq in enumerate(seqs)], limits.max if limits.max is not None else 10 * limits.p90)
        clients = []
        for client, supervisor in zip(session.clients, session.supervisors):     # every server must agree
            supervisor.expected = expected
            clients.append(_Supervised(client, supervisor))
        stats = verification.diff_stats(verification.server_diffs(trainer_lp, probe, clients))
    dist.broadcast(stats, src=0)                         # a CPU tensor: gloo, also on GPU runs
    problem = verification.failure(stats, limits)
    if problem:
        raise Stop(f"weight-sync verification failed at version {version} ({session.dtype}): {problem} "
                   "(server and trainer disagree)")
    return verification.as_metrics(stats)


class _Supervised:
    """A client whose verification requests go through its server's supervisor (a crash
    restarts the server, re-sends the weights and redoes the request)."""

    def __init__(self, client: RolloutClient, supervisor: ServerSupervisor) -> None:
        self.client, self.supervisor = client, supervisor

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        return self.supervisor.call("the sync verification", self.client.prompt_logprobs, seqs)
