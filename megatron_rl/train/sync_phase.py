"""Weight sync and its verification: the actor's weights go to every rollout server under a
version, and the servers' log-probs of a fixed probe batch must match the trainer's."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..megatron.devices import wait_for_rank0
from ..rollout.client import RolloutClient, SamplingSettings
from ..rollout.supervisor import ProbeExpectation, ServerSupervisor
from ..sync import SyncReport
from ..sync import verify as verification
from ..sync.lora import sync_actor
from ..types import TrainBatch
from .run_control import Stop


def push_weights(session: Any, version: int) -> SyncReport | None:
    """Send the actor's weights to the servers as `version` (collective; rank 0 gets the report)."""
    # Rank 0 may have spent minutes starting the server or generating: wait for it on the CPU,
    # not inside the NCCL collectives of the gather.
    wait_for_rank0()
    return sync_actor(session.actor, session.adapter, session.transport, version, session.dtype)


def sync_metrics(report: SyncReport | None) -> dict[str, float]:
    if report is None:
        return {}
    return {"sync/seconds": report.seconds, "sync/mb": report.bytes / 2**20, "sync/parts": report.parts}


def calibrate(session: Any, forced: TrainBatch, version: int, seq_len: int, pad: int) -> tuple[TrainBatch, Any,
                                                                                            dict[str, float]]:
    """The start-up measurement of the gate (collective): the server samples a completion of each
    forced-probe prompt; with the same weights on both sides (`version`), |Δ| on those sampled
    tokens is the kernel noise floor the later syncs are gated against (`verification.calibrate`).
    Returns (the probe of every later verification, the gate, the start-up metrics)."""
    box: list[Any] = [None]
    if session.rank0:
        prompts = [row[:int(m.nonzero().min()) + 1].tolist() for row, m in zip(forced.tokens, forced.mask)]
        r = session.cfg.rollout
        settings = SamplingSettings(n=1, temperature=1.0, top_p=1.0, top_k=-1,
                                    max_tokens=min(verification.PROBE_TOKENS, r.max_response_length))
        samples = session.supervisors[0].call("the verification probe", session.clients[0].generate, prompts, settings)
        box[0] = verification.sampled_probe(prompts, [group[0].response_ids for group in samples], seq_len, pad)
    dist.broadcast_object_list(box, src=0)
    probe = forced if box[0] is None else box[0]
    tolerance = session.cfg.rollout.verify_tolerance
    stats = _probe_stats(session, probe, version, verification.startup_limits(session.dtype, tolerance))
    problem = verification.failure(stats, verification.startup_limits(session.dtype, tolerance))
    if problem:
        raise Stop(f"start-up verification failed at version {version} ({session.dtype}): {problem} (server and "
                   "trainer disagree on the same weights: another model, or a broken load)")
    gate = verification.calibrate(stats, session.dtype, tolerance)
    return probe, gate, {**verification.as_metrics(stats), **verification.gate_metrics(gate)}


def calibrates_before_push(session: Any, resumed: bool) -> bool:
    """Whether the servers' own load of the checkpoint equals the trainer's weights, so that the
    noise floor is measured before any sync (and the first sync is gated): a fresh run from an HF
    directory with an unquantized base. Otherwise the floor is measured after the first sync."""
    return not resumed and not session.init.megatron and session.actor.quantization is None


def verify(session: Any, probe: TrainBatch, version: int, gate: verification.Gate) -> dict[str, float]:
    """Server log-probs of the probe vs the trainer's own (T = 1): statistics of |Δ| over the
    probe's verified tokens, gated by the run's calibrated bounds (`verification`).
    Collective: every rank returns the metrics or raises `Stop`."""
    stats = _probe_stats(session, probe, version, gate.limits)
    problem = verification.failure(stats, gate.limits)
    if problem:
        floor = dict(zip(verification.STATS, gate.floor))
        raise Stop(f"weight-sync verification failed at version {version} ({session.dtype}): {problem} (server and "
                   f"trainer disagree; the start-up noise floor was mean {floor.get('mean', float('nan')):.3g}, "
                   f"p90 {floor.get('p90', float('nan')):.3g})")
    return verification.as_metrics(stats)


def _probe_stats(session: Any, probe: TrainBatch, version: int, limits: verification.Limits) -> torch.Tensor:
    """`diff_stats` of server minus trainer over every server (collective; every rank gets them)."""
    trainer_lp = session.actor.compute_logprobs(probe, temperature=1.0)      # on the CPU
    stats = torch.zeros(len(verification.STATS), dtype=torch.float64)
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
    return stats


class _Supervised:
    """A client whose verification requests go through its server's supervisor (a crash
    restarts the server, re-sends the weights and redoes the request)."""

    def __init__(self, client: RolloutClient, supervisor: ServerSupervisor) -> None:
        self.client, self.supervisor = client, supervisor

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        return self.supervisor.call("the sync verification", self.client.prompt_logprobs, seqs)
