"""One weight-transfer round through vLLM's engine routes, the same for every backend.

The trainer side of one sync is the same whatever carries the bytes: per server, /pause (waiting
for requests in flight) → /init_weight_transfer_engine (once per server process) →
/start_weight_update → /update_weights (one or more) → /finish_weight_update (with the version)
→ /reset_prefix_cache (KV blocks of the old weights) → /resume, and the workers' own check of
what they loaded (`mrl_check_loaded`: every worker of every DP engine compares its record with what
the trainer sent, and raises if they differ; vLLM answers a /collective_rpc with engine 0's results
only, `vllm/v1/engine/core_client.py:1699-1701`, but runs it on every engine and fails if any
engine's call fails, `:1262-1269`). What `/update_weights` carries is the
backend's business (`shm.py`: a manifest of segment files; `gpu.py`: vLLM's own nccl / ipc
payloads); the engines that receive it are in `rollout/engines/`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from ..rollout.server import CONTROL_TIMEOUT_S


class ControlEndpoint(Protocol):
    def post(self, path: str, body: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
             timeout: float = CONTROL_TIMEOUT_S) -> Any: ...

    def rpc(self, method: str, *args: str, timeout: float = CONTROL_TIMEOUT_S) -> list[Any]: ...


class EngineServer(ControlEndpoint, Protocol):
    """A rollout server as the weight-transfer driver sees it (`RolloutServer`)."""

    restarts: int
    token: str

    @property
    def base_url(self) -> str: ...


UPDATE_FLOOR_BYTES_PER_S = 1e9
"""The slowest load of an update allowed before its request times out: 1 GB/s, a tenth of the
shared file system the planner assumes (`planner/gpus.py` SHARED_FS_GB_S, 10 GB/s; /dev/shm and
the GPU paths are faster). QLoRA's first sync of Qwen3-235B (470 GB in one /update_weights under
`shm`) then gets 600 + 470 s, not a fixed 600 s that a slow load would overrun."""


def update_timeout_s(nbytes: float) -> float:
    """Seconds an update request (/update_weights, /finish_weight_update) may take for `nbytes`:
    at least a control request's CONTROL_TIMEOUT_S, plus `nbytes` at the floor rate."""
    return CONTROL_TIMEOUT_S + max(0.0, nbytes) / UPDATE_FLOOR_BYTES_PER_S


T = TypeVar("T")

ROUND_REQUESTS = 8
"""Requests of one engine round (`EngineLink.round`: pause … resume, the workers' check)."""
RESTART_ROUNDS = 6
"""Rounds one server's call may run: the first and one per supervised restart
(`ServerSupervisor.max_restarts`, 5)."""


def round_deadline_s(nbytes: float) -> float:
    """The longest one server's supervised round of `nbytes` may take before the trainer stops
    waiting for it: every request of every round at its own timeout. A healthy round never gets
    near it (each request ends at its timeout, a dead server at once); it bounds a thread that
    would otherwise be waited for for ever."""
    return RESTART_ROUNDS * (ROUND_REQUESTS * CONTROL_TIMEOUT_S + 2 * update_timeout_s(nbytes))


class ServersFailed(RuntimeError):
    """The round failed on some servers (each named, with its error); the others completed it."""


def on_every_server(servers: Sequence[EngineServer], calls: Sequence[Callable[[], T]], what: str,
                    deadline_s: float) -> list[T]:
    """`calls[k]()` for server k, all at once, one thread each (one server: here, as it is).

    Each server's round is its own: a server that fails (or is restarted under its supervisor)
    holds up no other, and every server's round is waited for to its end (none is left paused)
    before the errors are raised together, each naming its server. A thread still running after
    `deadline_s` is given up on (named too): its requests have timeouts of their own, so that
    happens only if one ignored them."""
    if len(calls) == 1:
        return [calls[0]()]
    results: list[Any] = [None] * len(calls)
    errors: dict[int, BaseException] = {}

    def run(k: int) -> None:
        try:
            results[k] = calls[k]()
        except BaseException as exc:     # noqa: BLE001 - raised below, naming the server
            errors[k] = exc

    threads = [threading.Thread(target=run, args=(k,), name=f"{what} {s.base_url}", daemon=True)
               for k, s in enumerate(servers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + deadline_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [k for k, t in enumerate(threads) if t.is_alive()]
    if errors or hung:
        lines = [f"{servers[k].base_url}: {type(e).__name__}: {e}" for k, e in sorted(errors.items())]
        lines += [f"{servers[k].base_url}: no answer after {deadline_s:.0f} s" for k in hung]
        first = errors[min(errors)] if errors else None
        raise ServersFailed(f"{what} failed on {len(lines)} of {len(calls)} servers: " + "; ".join(lines)) from first
    return results


def direct(phase: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`EngineLink.supervise` without a supervisor: the call as it is."""
    return fn(*args)


def one_result(results: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's collective RPC answers once per worker (TP × PP of an engine; under DP, those of
    the first engine). Every worker loads the whole update, so all must report the same one:
    a worker that loaded another version or another number of tensors is an error. Each worker's
    own phase timings (`seconds`, bench/sync_bench.py's) differ by nature: the slowest is kept."""
    if not results:
        raise RuntimeError("the server returned no worker result")
    first = {k: v for k, v in results[0].items() if k != "seconds"}
    for i, r in enumerate(results[1:], start=1):
        if {k: v for k, v in r.items() if k != "seconds"} != first:
            raise RuntimeError(f"vLLM workers disagree: worker 0 reported {first}, worker {i} {r}")
    timed = [r["seconds"] for r in results if isinstance(r.get("seconds"), dict)]
    if timed:
        first["seconds"] = {k: max(t.get(k, 0.0) for t in timed) for k in timed[0]}
    return {**first, "workers": len(results)}


class EngineLink:
    """The weight-transfer routes of one server; `supervise` wraps each whole round (a server that
    dies under it is restarted and the round redone from /pause)."""

    def __init__(self, server: EngineServer, init_info: dict[str, Any] | None = None) -> None:
        self.server = server
        self.init_info = init_info or {}
        self.supervise: Callable[..., Any] = direct
        self._ready_for: int | None = None
        """`server.restarts` when the engine was initialised: a restarted server needs it again."""

    def init_engine(self, init_info: dict[str, Any] | None = None) -> None:
        self.server.post("/init_weight_transfer_engine", {"init_info": self.init_info if init_info is None
                                                          else init_info})
        self._ready_for = self.server.restarts

    def start(self) -> None:
        """Pause and open an update; the caller sends, then calls `finish` (or `resume`)."""
        self.server.post("/pause", params={"mode": "wait"})
        try:
            if self._ready_for != self.server.restarts:
                self.init_engine()
            self.server.post("/start_weight_update")
        except BaseException:
            self.server.post("/resume")
            raise

    def update(self, update_info: dict[str, Any], nbytes: float = 0) -> None:
        """Send one update of `nbytes` (its request's timeout grows with them: `update_timeout_s`)."""
        self.server.post("/update_weights", {"update_info": update_info}, timeout=update_timeout_s(nbytes))

    def finish(self, version: int, nbytes: float = 0, expect: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the update of `nbytes` in all (vLLM finalises the reloaded layers: its timeout
        grows with them), drop the KV cache of the old weights, resume; what the workers loaded.
        With `expect` (fields of the workers' `LOADED` record), every worker of every engine checks
        that it loaded exactly that, and the call fails if one did not."""
        try:
            self.server.post("/finish_weight_update", {"weight_version": str(version)},
                             timeout=update_timeout_s(nbytes))
            loaded = one_result(self.server.rpc("mrl_loaded") if expect is None
                                else self.server.rpc("mrl_check_loaded", json.dumps(expect)))
            self.server.post("/reset_prefix_cache")
        finally:
            self.server.post("/resume")
        return loaded

    def round(self, version: int, updates: Sequence[dict[str, Any]], nbytes: Sequence[float] = (),
              expect: dict[str, Any] | None = None) -> dict[str, Any]:
        """One whole round; `nbytes`: each update's bytes (for the timeouts; none: the least);
        `expect`: what every worker must have loaded (`finish`)."""
        sizes = list(nbytes) or [0.0] * len(updates)
        self.start()
        try:
            for update, size in zip(updates, sizes, strict=True):
                self.update(update, size)
        except BaseException:
            self.server.post("/resume")
            raise
        return self.finish(version, sum(sizes), expect)
