"""Watch a rollout server from the trainer's side: whole or nothing, and no wait outlives it.

Each started server gets a `ServerWatch` thread from its healthy start to its stop. Every second it
looks at the server's processes (the API process and every process under it, as they appear)
and, every few seconds, asks its health route:
- a process of the server that died (the API process, the engine core, one worker) takes the
  rest with it: the watch kills the server's whole process group. Every connection to it is then
  closed by the kernel, so every request the trainer has in flight (generation, a sync route,
  verification, eval, sleep/wake) fails at once and goes to the supervisor's recovery, instead of
  waiting for its own timeout; and the port is free for the restart.
- a server that is alive but makes no progress — its health route unanswered, or one of its
  processes stopped (SIGSTOP, a debugger) — for `rollout.hang_timeout_s` in a row is killed the
  same way. Progress, not request length: a long generation or weight update keeps answering
  /health and keeps running, and never trips it.
An external server (started by someone else) cannot be killed from here: its watch only marks
it down once the health route went unanswered for `hang_timeout_s`; waits on it then end
(`RolloutServer.post`, `RolloutClient`'s `down` check) and the supervisor stops the run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import httpx
import psutil

POLL_S = 1.0
"""How often the processes are looked at: a death is acted on within about this long."""
HEALTH_EVERY_S = 3.0
HEALTH_TIMEOUT_S = 5.0
"""A health probe unanswered this long counts as no progress (the server's event loop answers
/health between everything else it does, in well under a second even under load)."""


class ServerWatch:
    """One server incarnation's watch (see the module docstring)."""

    def __init__(self, url: str, pid: int | None, hang_timeout_s: float, name: str = "rollout server",
                 on_down: Callable[[str], None] | None = None) -> None:
        self.url = url
        self.pid = pid
        """The API process (None: an external server, watched through /health only)."""
        self.hang_timeout_s = hang_timeout_s
        self.name = name
        self.on_down = on_down
        self.down: str | None = None
        """Why the server is down (set once; None while it is up)."""
        self.known: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch {url}", daemon=True)

    def start(self) -> ServerWatch:
        if self.pid is not None:
            self._add_processes()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def processes(self) -> list[int]:
        """The pids of the server's processes seen so far."""
        return sorted(self.known)

    def _add_processes(self) -> None:
        """The API process and vLLM's processes under it (named `VLLM::…`: the engine core, its
        workers), not the helpers that come and go (multiprocessing's resource tracker, torch's
        compile workers, a tool run once)."""
        assert self.pid is not None
        try:
            api = psutil.Process(self.pid)
            self.known.setdefault(api.pid, api)
            for p in api.children(recursive=True):
                if p.pid not in self.known and _is_server_process(p):
                    self.known[p.pid] = p
        except psutil.NoSuchProcess:
            pass

    def _dead_process(self) -> int | None:
        for pid, p in self.known.items():
            try:
                if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                    return pid
            except psutil.NoSuchProcess:
                return pid
        return None

    def _stopped(self) -> int | None:
        for pid, p in self.known.items():
            try:
                if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                    return pid
            except psutil.NoSuchProcess:
                pass
        return None

    def _run(self) -> None:
        last_health = 0.0
        stalled_since: float | None = None
        with httpx.Client() as http:
            while not self._stop.wait(POLL_S) and self.down is None:
                now = time.monotonic()
                if self.pid is not None:
                    dead = self._dead_process()
                    if dead is not None:
                        self._declare(f"process {dead} of the {self.name} died", kill=True)
                        return
                    self._add_processes()
                    stopped = self._stopped()
                else:
                    stopped = None
                if now - last_health >= HEALTH_EVERY_S or stopped is not None:
                    last_health = now
                    stalled = stopped is not None or not _answers(http, self.url)
                    stalled_since = (stalled_since or now) if stalled else None   # since the probe began
                    now = time.monotonic()
                if stalled_since is not None and now - stalled_since >= self.hang_timeout_s:
                    what = f"process {stopped} stopped" if stopped is not None else "/health unanswered"
                    self._declare(f"the {self.name} made no progress for {now - stalled_since:.0f} s ({what}; "
                                  f"rollout.hang_timeout_s {self.hang_timeout_s:g})", kill=self.pid is not None)
                    return

    def _declare(self, reason: str, kill: bool) -> None:
        self.down = reason
        print(f"[rollout] {reason}: {'killing all of it' if kill else 'its waits end here'}", flush=True)
        if kill and self.pid is not None:
            kill_whole(self.pid, list(self.known.values()))
        if self.on_down is not None:
            self.on_down(reason)


def _is_server_process(p: psutil.Process) -> bool:
    """A `VLLM::…` process vLLM named itself. A child forked by one (the engine core runs helper
    programs on its first requests: seen, short-lived python and g++ processes) carries its
    parent's name until it execs or exits; adopted in that window, its exit was taken for the
    server's death and the whole healthy server killed (CI, under load, after a restart)."""
    try:
        name = p.name()
        if not name.startswith("VLLM"):
            return False
        parent = p.parent()
        return parent is None or parent.name() != name
    except psutil.Error:
        return False


def _answers(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url + "/health", timeout=HEALTH_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


def kill_whole(group: int, processes: list[psutil.Process]) -> None:
    """SIGKILL the server's process group and every process of it seen (one that left the group
    included: psutil checks it is still that process, not a reused pid); a stopped process dies of
    SIGKILL too."""
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in processes:
        try:
            p.kill()
        except psutil.Error:
            pass
