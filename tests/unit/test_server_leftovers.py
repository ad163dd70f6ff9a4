"""Which /dev/shm and temp-directory names are a rollout server's own, and that nothing of them
is left once it is gone: stopped, SIGKILLed and restarted, or orphaned by a dead trainer
(`rollout/shm.py`). The servers here are stand-ins that map a `psm_*` file and write a
`vllm_dist_*` file into their temp directory, as vLLM's engine does, and never clean up after
themselves, as a SIGKILLed vLLM does not."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout import shm
from megatron_rl.rollout.server import AddressTaken, RolloutServer, ServerError, ServerExited
from tests.helpers.rollout import REPO

SERVER = r'''
import http.server, mmap, os, sys, tempfile
open(os.path.join(tempfile.gettempdir(), "vllm_dist_stand_in"), "w").close()   # vLLM's FileStore file
f = open(f"/dev/shm/psm_mrltest_{os.getpid()}", "w+b")                         # its scheduler queue
f.truncate(4096)
queue = mmap.mmap(f.fileno(), 4096)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
'''


class StandIn(RolloutServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", SERVER, str(self.port)]


@contextmanager
def mapped(path: Path) -> Iterator[None]:
    """`path` (4 KiB) mapped by this test process, as by a process still using it."""
    with open(path, "a+b") as f:
        f.truncate(4096)
        with mmap.mmap(f.fileno(), 4096):
            yield


def _queue_of(server: RolloutServer) -> Path:
    return shm.SHM / f"psm_mrltest_{server.proc.pid}"


def _wait_for(cond: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False


def test_a_groups_segments_are_the_files_its_processes_map_or_hold_open(tmp_path: Path) -> None:
    code = ("import mmap, sys, time; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 4096); "
            "g = open(sys.argv[2]); print('ready', flush=True); time.sleep(60)")
    for name in ("psm_child", "sem.mp-child", "psm_ours", "psm_nobody"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "psm_child"), str(tmp_path / "sem.mp-child")],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        with mapped(tmp_path / "psm_ours"):
            assert shm.group_segments(child.pid, tmp_path) == ["psm_child", "sem.mp-child"]
            names = shm.group_segments(child.pid, tmp_path)
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            # `psm_ours` is in use: named or not, it stays.
            shm.remove_after_group(child.pid, [*names, "psm_ours"], root=tmp_path, timeout_s=10)
            assert sorted(p.name for p in tmp_path.iterdir()) == ["psm_nobody", "psm_ours"]
    finally:
        child.kill()
    theirs, ours = tmp_path / "a-users-tmpdir", tmp_path / f"{shm.SERVER_TMP_PREFIX}1-x"
    theirs.mkdir(), ours.mkdir()
    shm.remove_server_tmp_dir(theirs)
    shm.remove_server_tmp_dir(ours)
    assert theirs.is_dir() and not ours.exists()           # only a server's own temp directory goes


def test_a_stop_removes_what_its_killed_server_left_and_restarts_keep_the_first_baseline(tmp_path: Path) -> None:
    server = StandIn("model", tmp_path / "run", RolloutConfig(startup_timeout_s=60), 64, stop_token_ids=[0])
    other = shm.SHM / f"psm_mrltest_other_{os.getpid()}"      # another program's, created meanwhile
    first_queue = None
    try:
        server.start()
        baseline, first_tmp, first_queue = server.shm_before, server.tmp_dir, _queue_of(server)
        assert first_tmp is not None and first_tmp.name.startswith(shm.SERVER_TMP_PREFIX)
        assert (first_tmp / "vllm_dist_stand_in").is_file()          # TMPDIR reached the server
        # ...but torch's compile cache there is the shared one, which outlives the server.
        (inductor,) = [p for p in first_tmp.iterdir() if p.name.startswith("torchinductor_")]
        shared = inductor.resolve()
        assert inductor.is_symlink() and shared.parent == Path(tempfile.gettempdir()).resolve()
        assert first_queue.is_file() and first_queue.name not in baseline
        os.killpg(server.proc.pid, signal.SIGKILL)                   # as the fault bench does
        server.proc.wait()
        with mapped(first_queue), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)    # a start's log left open for the GC
            server.restart()                   # (a process of the killed group still tearing down)
        assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
        assert server.shm_before is not None and first_queue.name not in server.shm_before   # still ours
        assert first_queue.exists() and not first_tmp.exists()
        second_tmp, second_queue = server.tmp_dir, _queue_of(server)
        assert second_tmp is not None and second_queue.is_file()
        with mapped(other):
            server.stop()
            assert not first_queue.exists() and not second_queue.exists() and not second_tmp.exists()
            assert other.exists()                                    # in use: not ours to remove
        assert server.tmp_dir is None and server.proc is None and shared.is_dir()
    finally:
        server.stop()
        for f in (other, first_queue):
            if f is not None:
                f.unlink(missing_ok=True)


def test_a_server_whose_trainer_died_removes_its_files_as_its_watchdog_kills_it() -> None:
    """The trainer SIGKILLed: nobody will stop its server. The server's watchdog SIGKILLs its own
    group (server_main.py) and hands what the group maps, and its temp directory, to a detached
    clean-up first."""
    tmp = shm.new_server_tmp_dir()
    code = ("import mmap, os, time; from megatron_rl.rollout.server_main import _watch_parent; "
            "f = open(f'/dev/shm/psm_mrltest_{os.getpid()}', 'w+b'); f.truncate(4096); "
            "q = mmap.mmap(f.fileno(), 4096); open(os.path.join(os.environ['TMPDIR'], 'vllm_dist_x'), 'w').close(); "
            "_watch_parent(); print('ready', flush=True); time.sleep(60)")
    trainer = subprocess.Popen(["sleep", "60"])
    env = dict(os.environ, MRL_PARENT_PID=str(trainer.pid), TMPDIR=str(tmp), PYTHONPATH=str(REPO),
               **{shm.SERVER_TMP_ENV: str(tmp)})
    server = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True, cwd=REPO)
    queue = shm.SHM / f"psm_mrltest_{server.pid}"
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        assert queue.is_file() and (tmp / "vllm_dist_x").is_file()
        trainer.kill()
        trainer.wait()
        assert server.wait(timeout=30) == -signal.SIGKILL
        assert _wait_for(lambda: not queue.exists() and not tmp.exists()), (queue.exists(), tmp.exists())
    finally:
        trainer.kill()
        server.kill()
        queue.unlink(missing_ok=True)
        shm.remove_server_tmp_dir(tmp)


STOPPING_TRAINER = r'''
import signal, sys
from pathlib import Path
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.server import RolloutServer

SERVER = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + sys.argv[2]  # a stop waits

class StandIn(RolloutServer):
    def command(self):
        return [sys.executable, "-c", SERVER, str(self.port)]

server = StandIn("model", Path(sys.argv[1]), RolloutConfig(startup_timeout_s=60), 64, stop_token_ids=[0])
server.start()
print(server.proc.pid, server.tmp_dir, flush=True)
sys.stdin.readline()
server.stop()
'''


def test_a_trainer_killed_while_it_stops_its_server_leaves_nothing_of_it(tmp_path: Path) -> None:
    """The fault bench's trainer SIGKILLed in the middle of a restart: `stop` had signalled the
    server and was waiting for it. Its clean-up was handed to a detached process first."""
    trainer = subprocess.Popen([sys.executable, "-c", STOPPING_TRAINER, str(tmp_path / "run"), SERVER],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                               env=dict(os.environ, PYTHONPATH=str(REPO)))
    pgid = 0
    try:
        assert trainer.stdin is not None and trainer.stdout is not None
        pid, tmp_dir = trainer.stdout.readline().split()
        pgid, tmp, queue = int(pid), Path(tmp_dir), shm.SHM / f"psm_mrltest_{pid}"
        assert _wait_for(queue.is_file) and tmp.is_dir()
        trainer.stdin.write("stop\n")
        trainer.stdin.flush()
        assert _wait_for(lambda: len(list(Path("/proc").glob("*/cmdline"))) > 0 and _detached_remover_of(pgid))
        trainer.kill()                                  # in stop's wait for the SIGTERM-deaf server
        trainer.wait()
        os.killpg(pgid, signal.SIGKILL)                 # as its watchdog or the OOM killer would
        assert _wait_for(lambda: not queue.exists() and not tmp.exists(), 15.0), (queue.exists(), tmp.exists())
    finally:
        trainer.kill()
        if pgid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            (shm.SHM / f"psm_mrltest_{pgid}").unlink(missing_ok=True)


def test_the_cpu_tensor_parallel_blocks_are_a_servers_leftovers_too(tmp_path: Path) -> None:
    # vLLM's CPU communicator (`cpu_communicator.py:237-243`): one 4 MiB block per TP worker.
    block = tmp_path / "vllm_dist_0123abcd-tp:0-[0-1]-cpushm_0"
    block.write_bytes(b"x" * 4096)
    with mapped(block):
        assert shm.stale_vllm_segments(tmp_path, 0.0) == []
    assert shm.stale_vllm_segments(tmp_path, 0.0) == [block]


def _detached_remover_of(pgid: int) -> bool:
    for cmdline in Path("/proc").glob("*/cmdline"):
        with contextlib.suppress(OSError):
            if f"--after-group\0{pgid}\0" in cmdline.read_text():
                return True
    return False


TAKEN_ONCE = r'''
import os, sys
marker = sys.argv[2]
if not os.path.exists(marker):
    open(marker, "w").close()
    print("starting the engine core", flush=True)
    sys.exit("OSError: [Errno 98] Address already in use")
''' + SERVER


class TakenOnce(RolloutServer):
    """Loses a port to another process on its first start, as vLLM's free-then-bind ports can."""
    def command(self) -> list[str]:
        return [sys.executable, "-c", TAKEN_ONCE, str(self.port), str(self.run_dir / "tried")]


def test_a_start_that_lost_a_port_starts_again_and_other_failures_show_the_log(tmp_path: Path) -> None:
    server = TakenOnce("model", tmp_path / "run", RolloutConfig(startup_timeout_s=60), 64, stop_token_ids=[0])
    try:
        server.start()
        assert server.alive() and server.healthy()
        first_port = server.port
        log = (server.rollout_dir / "server.log").read_text()
        assert log.count("Address already in use") == 1 and "starting the engine core" in log
    finally:
        server.stop()
    # Any other failure is raised, with the lines of this start (not the earlier ones) in the error.
    (tmp_path / "run" / "tried").unlink()
    broken = TakenOnce("model", tmp_path / "run", RolloutConfig(startup_timeout_s=60, port=first_port), 64,
                       stop_token_ids=[0])
    broken.command = lambda: [sys.executable, "-c", "import sys; print('fresh line'); sys.exit('no model here')"]
    with pytest.raises(ServerError) as raised:
        broken.start()
    assert isinstance(raised.value, ServerExited) and not isinstance(raised.value, AddressTaken)
    assert "which ends:\n  | fresh line\n  | no model here" in str(raised.value)
    assert "Address already in use" not in str(raised.value)
    assert broken.proc is None and broken.tmp_dir is None


def test_only_a_failed_bind_counts_as_a_lost_port() -> None:
    from megatron_rl.rollout.server import _lost_a_port

    assert _lost_a_port("ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): "
                        "address already in use")                                     # uvicorn
    assert _lost_a_port("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5555')")
    # vLLM's own DP retry, followed by an unrelated failure: not a lost port.
    assert not _lost_a_port("WARNING [parallel.py:746] Address already in use. Retrying with a new port.\n"
                            "torch.OutOfMemoryError: CUDA out of memory")
