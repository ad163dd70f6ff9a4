"""A rollout server dies whole, and the trainer's watch of it, on real processes laid out as a
vLLM server is (an API process answering /health in its own session, with `VLLM::…` children
forked from it) but without vLLM: the binding of `server_main` and `rollout/watch.py` act on
processes, not on what runs in them. The vLLM server itself: tests/integration/test_server_dies_whole.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.ports import free_port
from megatron_rl.rollout.watch import ServerWatch
from tests.helpers.rollout import REPO
from tests.helpers.train import ENV

# The stand-in server: binds its port as vLLM's setup_server does (noted for the children to
# close), forks two children by multiprocessing (engine core, worker; the second from the
# first), names them VLLM::…, answers /health (slowly while a /slow request runs elsewhere).
# With "helpers", the engine core also forks a short-lived child every second that keeps its
# name (a helper between fork and exec), as vLLM's engine core does on its first requests.
SERVER = r"""
import json, os, socket, sys, threading, time, multiprocessing, ctypes
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from megatron_rl.rollout import server_main

port, out = int(sys.argv[1]), sys.argv[2]
helpers = sys.argv[3:] == ["helpers"]
sock = socket.create_server(("127.0.0.1", port))
server_main._listening.append(sock)
server_main._bind_forked_children()

def fork_helpers():
    while True:
        time.sleep(1)
        pid = os.fork()
        if pid == 0:
            time.sleep(1.5)
            os._exit(0)
        os.waitpid(pid, 0)

def named(title, then=None):
    ctypes.CDLL(None).prctl(15, title.encode(), 0, 0, 0)        # PR_SET_NAME, as setproctitle does
    if then:
        multiprocessing.get_context("fork").Process(target=named, args=(then,)).start()
        if helpers:
            threading.Thread(target=fork_helpers, daemon=True).start()
    while True:
        time.sleep(1)

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow":
            time.sleep(3)
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass

multiprocessing.get_context("fork").Process(target=named, args=("VLLM::EngineCore", "VLLM::Worker")).start()
http = ThreadingHTTPServer(("127.0.0.1", port), H, bind_and_activate=False)
http.socket.close(); http.socket = sock; sock.listen()
open(out, "w").write("ready")
http.serve_forever()
"""


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, int, list[psutil.Process]]:
    port = free_port("127.0.0.1")
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(ready), *extra], env=ENV, cwd=REPO,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = [k for k in (psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else [])
                if _engine_or_worker(k, proc.pid)]
        if ready.is_file() and len(kids) == 2:
            return proc, port, kids
        time.sleep(0.1)
    proc.kill()
    pytest.fail("the stand-in server did not start")


def _engine_or_worker(p: psutil.Process, api: int) -> bool:
    """The engine core (a child of the API process) or the worker, not one of the engine's helpers."""
    try:
        name = p.name()
        return name.startswith("VLLM") and (p.ppid() == api or name == "VLLM::Worker")
    except psutil.NoSuchProcess:        # a helper that exited meanwhile
        return False


def _gone(procs: list[psutil.Process], within_s: float) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=within_s)
    return not alive


def _bound(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return False
        except OSError:
            return True


@pytest.fixture
def killed_after() -> list[subprocess.Popen]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_children_die_with_the_api_process_and_never_held_its_socket(tmp_path: Path, killed_after: list) -> None:
    proc, port, kids = _start(tmp_path)
    killed_after.append(proc)
    # Only the API process has the listening socket (the children closed their copies at fork).
    holders = {c.pid for p in [psutil.Process(proc.pid), *kids] for c in [p]
               if any(k.laddr.port == port for k in p.net_connections(kind="tcp"))}
    assert holders == {proc.pid}
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)                 # the API process alone, as the OOM killer does
    assert _gone(kids, within_s=5), [k for k in kids if k.is_running()]
    print(json.dumps({"children_gone_s": round(time.monotonic() - t0, 2)}))
    proc.wait()
    assert not _bound(port)                           # the port binds again


def test_the_watch_kills_the_whole_server_when_one_process_dies(tmp_path: Path, killed_after: list) -> None:
    proc, port, kids = _start(tmp_path)
    killed_after.append(proc)
    watch = ServerWatch(f"http://127.0.0.1:{port}", proc.pid, hang_timeout_s=60).start()
    try:
        assert len(watch.processes()) == 3
        worker = next(k for k in kids if k.name() == "VLLM::Worker")
        t0 = time.monotonic()
        worker.kill()                                 # one worker dies alone
        assert _gone([psutil.Process(proc.pid), *kids], within_s=5)
        assert watch.down and f"process {worker.pid}" in watch.down
        assert time.monotonic() - t0 < 5
    finally:
        watch.stop()


def test_a_helper_that_a_vllm_process_forks_and_that_exits_is_not_the_server_dying(
        tmp_path: Path, killed_after: list) -> None:
    proc, port, kids = _start(tmp_path, "helpers")
    killed_after.append(proc)
    engine = next(k for k in kids if k.ppid() == proc.pid)
    watch = ServerWatch(f"http://127.0.0.1:{port}", proc.pid, hang_timeout_s=60).start()
    try:
        helpers: set[int] = set()
        deadline = time.monotonic() + 5               # two helpers come and go, each alive over a watch poll
        while time.monotonic() < deadline:
            for c in engine.children():
                try:
                    if c.name() == engine.name():
                        helpers.add(c.pid)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.1)
        assert len(helpers) >= 2
        assert watch.down is None and proc.poll() is None
        assert watch.processes() == sorted([proc.pid, *(k.pid for k in kids)])
    finally:
        watch.stop()


def test_a_stopped_server_is_declared_dead_after_the_hang_timeout_a_slow_answer_is_not(
        tmp_path: Path, killed_after: list) -> None:
    import httpx

    proc, port, kids = _start(tmp_path)
    killed_after.append(proc)
    url = f"http://127.0.0.1:{port}"
    watch = ServerWatch(url, proc.pid, hang_timeout_s=2).start()
    try:
        assert httpx.get(url + "/slow", timeout=30).status_code == 200     # 3 s, 1.5× the hang timeout
        assert watch.down is None
        os.kill(kids[0].pid, signal.SIGSTOP)          # the engine core stops; /health still answers
        t0 = time.monotonic()
        assert _gone([psutil.Process(proc.pid), *kids], within_s=10)
        assert watch.down and "stopped" in watch.down and 2 <= time.monotonic() - t0 < 10
    finally:
        watch.stop()


def test_an_external_server_that_stops_answering_ends_the_waits_on_it(tmp_path: Path, killed_after: list) -> None:
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.server import RolloutServer, ServerError

    proc, port, kids = _start(tmp_path)
    killed_after.append(proc)
    rollout = tmp_path / "ext" / "rollout"
    rollout.mkdir(parents=True)
    (rollout / "server.json").write_text(json.dumps({"url": f"http://127.0.0.1:{port}", "model": "m",
                                                     "stop_token_ids": [0]}))
    (rollout / "token").write_text("t")
    server = RolloutServer.attach(tmp_path / "ext", RolloutConfig(hang_timeout_s=2))
    try:
        os.kill(proc.pid, signal.SIGSTOP)            # its API process: nothing answers, nothing dies
        t0 = time.monotonic()
        with pytest.raises(ServerError, match="no progress"):
            server.post("/pause")                     # would wait for its 600 s timeout
        assert time.monotonic() - t0 < 15 and not server.alive()
        assert all(k.is_running() for k in kids)      # not ours to kill
    finally:
        assert server.watch is not None
        server.watch.stop()


def test_a_spawned_child_dies_with_the_process_that_spawned_it(tmp_path: Path) -> None:
    """vLLM's `spawn` children (on a GPU once CUDA is initialised) import the main module as
    `__mp_main__` before their target runs: server_main binds them there, by a watchdog thread
    (the kernel's parent-death signal would follow the spawning thread, unknown in the child)."""
    pid_file = tmp_path / "child"
    spawned = ("import runpy, os, time; runpy.run_module('megatron_rl.rollout.server_main', run_name='__mp_main__'); "
               f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {spawned!r}]); time.sleep(120)"],
                              env=ENV, cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = psutil.Process(int(pid_file.read_text()))
        parent.kill()
        parent.wait()
        assert _gone([child], within_s=5)
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
