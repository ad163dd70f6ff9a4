"""Keep a run's rollout server answering through every server call of a step.

The server can die at any moment (OOM, a killed process, an engine crash): during the per-step
reseed, a generation or verification request, or any call of a weight sync (pause, update, prefix
cache reset, resume). Every such call goes through `ServerSupervisor.call`, or — for the client's
concurrent requests — `on_failure`. A server this run started that is found dead is restarted on
the same port, brought to the latest complete weights (`resend_latest`), checked (the version the
worker reports, and when the trainer's log-probs of the probe are known for that version, the
server's own), and the interrupted call is then redone from its start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import httpx

from .client import RolloutClient, RolloutError
from .server import RolloutServer, ServerError

T = TypeVar("T")

CRASH_ERRORS: tuple[type[BaseException], ...] = (httpx.TransportError, ServerError, RolloutError)
"""What a dead server looks like to a caller (refused/reset connections, HTTP 5xx while it dies)."""
WATCH_GRACE_S = 3.0
"""How long an answered error waits for the server's watch (`rollout/watch.py`, 1 s polls) before it
counts as not a crash: vLLM answers HTTP 500 "Executor failed" as soon as one worker dies, before the
watch has seen the death and killed the group."""


class WeightSource(Protocol):
    @property
    def latest(self) -> Any: ...

    def resend_latest(self) -> dict[str, Any] | None: ...


class ServerLink(WeightSource, Protocol):
    """One server's end of the weight transport (`sync/`), as the run holds it: its supervisor
    wraps each round (`supervise`, set to `ServerSupervisor.call`) and re-sends through it."""

    supervise: Callable[..., Any]

    def close(self) -> None: ...


@dataclass
class ProbeExpectation:
    """The trainer's log-probs of the probe sequences at one weight version (None = not compared)."""

    version: int
    sequences: list[list[int]]
    logprobs: list[list[float | None]]
    tolerance: float


class ServerSupervisor:
    """Restarts a dead server that this run started and brings it back to the latest weights.

    Called from every failing request at once; the lock makes one of them restart the server
    and the others find it healthy afterwards.
    """

    def __init__(self, server: RolloutServer, transport: WeightSource | None = None, max_restarts: int = 5) -> None:
        self.server = server
        self.transport = transport
        self.max_restarts = max_restarts
        """Restarts in a row (the server dying again while it is brought back) before giving up."""
        self.expected: ProbeExpectation | None = None
        self.lock = threading.RLock()
        self.closed = False
        """Set when the run shuts its servers down: a request that fails then is not a crash to repair."""

    def __call__(self, error: Exception) -> None:
        """`RolloutClient.on_failure`: between retries of a failed request."""
        self.recover(error, "a rollout request")

    def call(self, phase: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, redone from its start after a restart whenever the server died under it."""
        for attempt in range(self.max_restarts + 1):
            try:
                return fn(*args, **kwargs)
            except CRASH_ERRORS as exc:
                if attempt == self.max_restarts or not self.recover(exc, phase):
                    raise
        raise AssertionError("unreachable")

    def recover(self, error: BaseException, phase: str) -> bool:
        """Restart the server if it is down; False if it is up (the error was not a crash)."""
        with self.lock:
            if self.closed:
                raise ServerError(f"{phase} failed while the run was stopping its servers "
                                  f"({error.__class__.__name__})") from error
            if self._stays_up(WATCH_GRACE_S if isinstance(error, ServerError) else 0.0):
                return False
            if self.server.external:
                raise ServerError(f"the external rollout server at {self.server.base_url} went down during "
                                  f"{phase} ({error.__class__.__name__}); the trainer does not restart servers "
                                  "it did not start")
            print(f"[rollout] server down during {phase} ({error.__class__.__name__}); restarting it and "
                  "re-sending the latest weights", flush=True)
            last: BaseException = error
            for _ in range(self.max_restarts):
                try:
                    self.server.restart()
                    loaded = self.transport.resend_latest() if self.transport is not None else None
                    self._check(loaded)
                    return True
                except CRASH_ERRORS as exc:       # died again while being brought back
                    last = exc
                    print(f"[rollout] restart failed ({exc.__class__.__name__}: {str(exc)[:200]}); retrying",
                          flush=True)
            raise ServerError(f"rollout server could not be restarted after {self.max_restarts} attempts "
                              f"(last: {last}); see {self.server.rollout_dir / 'server.log'}") from last

    def _stays_up(self, grace_s: float) -> bool:
        """The server is alive and healthy now and throughout the next `grace_s` seconds."""
        deadline = time.monotonic() + grace_s
        while self.server.alive() and self.server.healthy():
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.25)
        return False

    def _check(self, loaded: dict[str, Any] | None) -> None:
        """The restarted server holds the weights the trainer last sent (and, when known, computes
        the trainer's log-probs on them)."""
        want = self.transport.latest[0] if self.transport is not None and self.transport.latest else 0
        got = {int(v) for v in self.server.rpc("mrl_weight_version")}
        if got != {want}:
            raise RestartCheckFailed(f"restarted server reports weight version(s) {sorted(got)}, expected {want}")
        e = self.expected
        if e is None or e.version != want:
            print(f"[rollout] server restarted with weight version {want}", flush=True)
            return
        no_retries = replace(self.server.cfg, max_retries=0)
        client = RolloutClient.for_server(self.server, no_retries)     # no on_failure: not re-entrant
        worst = max_abs_diff(client.prompt_logprobs(e.sequences), e.logprobs)
        if not worst <= e.tolerance:
            raise RestartCheckFailed(f"restarted server disagrees with the trainer at version {want}: "
                                     f"max |Δ log-prob| {worst:.3g} > {e.tolerance:g}")
        print(f"[rollout] server restarted with weight version {want}, verified: max |Δ log-prob| {worst:.2g}",
              flush=True)


class RestartCheckFailed(RuntimeError):
    """The restarted server does not serve the trainer's weights (not a crash: no retry)."""


def max_abs_diff(got: Sequence[Sequence[float]], want: Sequence[Sequence[float | None]]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            if b is not None:
                d = abs(a - b)
                worst = d if d > worst or d != d else worst      # NaN wins
    return worst
