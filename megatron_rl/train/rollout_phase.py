"""Generate the step's rollout groups through the server, surviving a server crash.

Requests carry a seed derived from (run seed, step, prompt), so a re-issued request after a
restart returns the same samples; groups are keyed by prompt, so none is lost or duplicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..rollout.client import RolloutClient, SamplingSettings
from ..rollout.server import RolloutServer
from ..types import RolloutGroup
from ..weights.transport_file import FileTransport


class ServerSupervisor:
    """Restarts a dead server that this run started and reloads the latest synced weights."""

    def __init__(self, server: RolloutServer, transport: FileTransport) -> None:
        self.server = server
        self.transport = transport

    def __call__(self, error: Exception) -> None:
        if self.server.alive() and self.server.healthy():
            return                                    # a transient error: just retry
        print(f"[rollout] server down ({error.__class__.__name__}); restarting and re-syncing weights", flush=True)
        self.server.restart()
        self.transport.resend_latest()


def generate_groups(client: RolloutClient, prompts: Sequence[list[int]], records: Sequence[dict[str, Any]],
                    indices: Sequence[int], sampling: SamplingSettings, seed: int, step: int,
                    version: int) -> list[RolloutGroup]:
    seeds = [(seed * 1_000_003 + step * 10_007 + i) % (2**31 - 1) for i in indices]
    results = client.generate(prompts, sampling, seeds=seeds)
    groups = []
    for index, record, samples in zip(indices, records, results):
        for s in samples:
            s.weight_version = version
        groups.append(RolloutGroup(prompt_index=index, record=record, samples=samples))
    return groups
