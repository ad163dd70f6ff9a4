"""Fault-injection run: a tiny GRPO run whose rollout server is faulted at a chosen moment of many
steps, covering every phase, plus one SIGKILL of the trainer followed by `--resume`. The faults
(`--kinds`, `KINDS`): SIGKILL of the server's whole process group at every phase; and, at every
request in flight (generation, verification, each sync route), SIGKILL of its API process alone, of
its engine core alone, of one of its workers, and SIGSTOP of its API process. Prints JSON: faults
injected / survived, steps lost / logged twice, the seconds from each fault to the run going on
(the worst, the worst per kind, any over 60 s), the processes of faulted servers alive 10 s after
the fault or at the end, their ports that no longer bind, the listening sockets seen during the
run that were not on loopback, and /dev/shm files and temp dirs left behind.

    python bench/faults.py [--kinds group,api,engine,worker,stop] [--tp 2] [--steps N] [--seed 0]
                           [--max-staleness K] [--delta] [--out DIR] [--json-out FILE]

`--delta` trains in bf16 at lr 1e-6 with `rollout.sync_delta: on`, so that the syncs the faults
land in are sparse patches (`sync_rounds` in the JSON counts them); with `--max-staleness` too,
while the servers generate ahead (the trainer's own server reads its segments in this node's
/dev/shm, the same delta rounds as a rollout node's copy, `sync/network.py`).

Faults other than "group" run the server in vLLM's multiprocess layout (an engine core and a
worker beside the API process, as on a GPU), which a CPU server of one rank otherwise does not
use; `--tp 2` gives it two workers, so "worker" kills one of two.

`--max-staleness 1` runs the same plan with asynchronous rollout (`rollout.max_staleness: 1`,
placement disaggregated, the trainer starting its server itself so that its supervisor may restart
it): the servers generate the next step while the trainer trains, so a kill at an "idle" moment of
the trainer (log-probs, training, checkpoint) now lands in the middle of a generation, and the
phase's step is the step the servers were generating for.

The trainer runs in a child process (`--child`) that wraps a few functions to know which phase it
is in and kills the real server there; nothing is mocked. Phases: the per-step reseed, mid-
generation (a request of the step out, the next one going out), the verification request, each call of the weight
sync through vLLM's weight-transfer routes (/pause, /init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update, the workers' `mrl_check_loaded` check,
/reset_prefix_cache, /resume), and the moments the server is idle (the trainer computing
log-probs, training, writing the sync segments, saving a checkpoint: the death is met at the next
call). /init_weight_transfer_engine is called once per server process, so its kill comes while a
server killed earlier in the same step is being brought back; no other fault is injected while a
server is being brought back (one recovery, one fault).

The run fails (exit 1, `never_reached` / `not_met` in the JSON) when a planned injection point was
never reached, or a kill was never noticed (no server restart followed it), when the trained run
collapsed (`health`: its verdict from the `health/*` metrics, `train/health.py`): surviving faults
with a dead model is no result, and when a recovery took over 60 s or anything of a faulted server
was left. A recovery is a server restart (start to healthy: ~12 s for one rank on a quiet 2-core VM,
30-60 s under a load of 5-8; "stop" adds `HANG_TIMEOUT_S`) plus the re-send and check (~2 s); each
fault's share is in `recoveries`. So a run takes ~10 minutes for `--kinds group` (20 steps) and
~20-30 for all five kinds (57 steps) on a quiet machine, about twice that loaded.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SERVER_CALLS = {"/pause": "pause", "/init_weight_transfer_engine": "init", "/start_weight_update": "start",
                "/update_weights": "update", "/finish_weight_update": "finish",
                "/reset_prefix_cache": "reset", "/resume": "resume"}
"""The weight sync's routes (sync/routes.py `EngineLink`) → phase."""
RPCS = {"mrl_reseed": "reseed", "mrl_check_loaded": "loaded"}
"""`/collective_rpc` methods → phase (the workers' report of what they loaded ends each sync)."""
PHASES = ("reseed", "generate", "verify", *SERVER_CALLS.values(), "loaded", "logprobs", "train", "sync_write",
          "checkpoint")
SAVE_INTERVAL = 4
# The tiny recipe's own batch (16 prompts × 8 samples): at 16 × 4 the asynchronous run (staleness 1,
# lr 1e-3) drifted away between restarts (mismatch 0.02 → 0.13 in three steps, entropy ×5) and its
# health stopped it at step 9; at 4 × 4 a fault-free run is 'collapsed' by chance (all groups flat).
BRING_BACK = {"init": "train"}
"""Phases only reached while a server is brought back: first kill it at this (idle) moment of the
same step (the next sync restarts it, and the restart's re-send initialises the engine again)."""


KINDS = ("group", "api", "engine", "worker", "stop")
"""What a fault does to the server: SIGKILL of its whole process group ("group"), of its API process
alone ("api": what the OOM killer or a segfault takes), of its engine core alone ("engine"), of one
of its workers ("worker"; with --tp 2, one worker of two), or SIGSTOP of its API process ("stop":
alive, answering nothing; declared dead after rollout.hang_timeout_s)."""
PARTIAL_PHASES = ("generate", "verify", "pause", "start", "update", "finish", "loaded", "reset", "resume")
"""Where the faults other than "group" are injected: a request in flight or about to go out
(generation, verification, each sync route): a process of the server dies (or stops) under it."""
HANG_TIMEOUT_S = 10
"""rollout.hang_timeout_s of a run with "stop" faults."""
PRODUCER: contextvars.ContextVar[bool] = contextvars.ContextVar("producer", default=False)
"""Set in the asynchronous rollout's producer thread, and so in the threads its requests' recoveries
run in (the client's `on_failure` runs by `asyncio.to_thread`, which copies the context)."""
RECOVERING: contextvars.ContextVar[bool] = contextvars.ContextVar("recovering", default=False)
"""Set while this thread's supervisor brings a killed server back: the calls it makes then (the
restart's re-send and check) are not the step's own, and get no fault of their own (but a
bring-back phase's)."""


def fault_items(kinds: tuple[str, ...], phases: tuple[str, ...] = PARTIAL_PHASES) -> list[str]:
    """Each fault the plan must inject once: `phase` (a group kill) or `phase@kind` (at `phases`)."""
    items = [p for p in PHASES if p != "checkpoint"] if "group" in kinds else []
    return items + [f"{p}@{k}" for k in kinds if k != "group" for p in phases]


def phase_and_kind(item: str) -> tuple[str, str]:
    phase, _, kind = item.partition("@")
    return phase, kind or "group"


def steps_needed(kinds: tuple[str, ...], phases: tuple[str, ...] = PARTIAL_PHASES) -> int:
    """Steps for one pass over every fault (one a step, checkpoint kills on their own steps)."""
    need = len(fault_items(kinds, phases))
    steps = need + 1
    while steps - _checkpoint_steps(steps, kinds) < need:
        steps += 1
    return steps


def _checkpoint_steps(steps: int, kinds: tuple[str, ...]) -> int:
    return sum(1 for s in range(1, steps + 1) if _checkpoint_kill(s, steps, kinds))


def _checkpoint_kill(step: int, steps: int, kinds: tuple[str, ...]) -> bool:
    return "group" in kinds and step % SAVE_INTERVAL == 0 and step // SAVE_INTERVAL % 2 == 1 and step < steps


def schedule(steps: int, seed: int, kinds: tuple[str, ...] = ("group",),
             phases: tuple[str, ...] = PARTIAL_PHASES) -> dict[int, list[str]]:
    """Kills per step: every fault of `fault_items` at least once when steps allow (one per step,
    plus the kill that a bring-back phase needs first); checkpoint kills only at steps that save
    before the last (the last step's save is followed by no server call that could notice the death)."""
    rng = random.Random(seed)
    plan: dict[int, list[str]] = {}
    pool: list[str] = []
    for step in range(1, steps + 1):
        if _checkpoint_kill(step, steps, kinds):
            plan[step] = ["checkpoint"]
            continue
        if not pool:
            pool = fault_items(kinds, phases)
            rng.shuffle(pool)
        if plan.get(step - 1) == ["checkpoint"] and pool[-1] == "reseed":
            pool.insert(0, pool.pop())      # the checkpoint kill is met at this reseed: it must not be dead already
        phase = pool.pop()
        plan[step] = [BRING_BACK[phase], phase] if phase in BRING_BACK else [phase]
    return plan


# ---------------------------------------------------------------------------------------- child
def child(recipe: str, overrides: list[str], plan: dict[int, list[str]], log_path: Path, resume: bool) -> int:
    """Run `train` with the plan's kills wired in (this process only: the server stays real)."""
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()                            # before anything imports megatron-core (as the CLI does)
    import megatron_rl.megatron.checkpoint as checkpoint_mod
    from megatron_rl.config import load_recipe
    from megatron_rl.megatron.actor import Actor
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.server import RolloutServer
    from megatron_rl.rollout.supervisor import ServerSupervisor
    from megatron_rl.sync import verify as verification
    from megatron_rl.sync.shm import SegmentWriter, SharedSegmentTransport
    from megatron_rl.train import loop
    from megatron_rl.train.ahead import AheadRollouts
    from megatron_rl.train.fleet import RolloutFleet
    from megatron_rl.train.loop import train
    from megatron_rl.train.policy import Policy
    from megatron_rl.train.publisher import WeightPublisher

    # The step a phase belongs to: the one being generated (the rollout producer's thread, or the
    # loop's own generation) or the one being trained; the same step in the synchronous loop. A
    # bring-back phase belongs to the step of the kill whose server is being brought back.
    state: dict[str, Any] = {"generating": 0, "training": 0, "killed_at": 0, "server": None, "done": set(),
                             "in_verify": False, "answered": 0, "outstanding": 0,
                             "restart_s": {}}

    def step_of(phase: str) -> int:
        if phase in BRING_BACK:
            return int(state["killed_at"])
        return int(state["generating"] if PRODUCER.get() or phase in ("reseed", "generate") else state["training"])

    def inject(phase: str) -> None:
        if RECOVERING.get() and phase not in BRING_BACK:
            return      # a second fault inside one recovery would be timed as the first's
        step = step_of(phase)
        server = state["server"]
        items = [i for i in plan.get(step, []) if phase_and_kind(i)[0] == phase and (step, i) not in state["done"]]
        if not items or server is None or server.proc is None:
            return
        if server.proc.poll() is not None or server.down:
            return      # killed earlier and not yet noticed: no kill of its own (reported as never reached)
        item = items[0]
        kind = phase_and_kind(item)[1]
        victim = fault_target(server, kind)
        if victim is None:
            return      # no such process in this layout (reported as never reached)
        state["done"].add((step, item))
        state["killed_at"] = step
        old = server.processes()
        record = {"step": step, "phase": phase, "kind": kind, "pid": server.proc.pid, "victim": victim,
                  "processes": old, "port": server.port, "restarts": server.restarts,
                  "trainer_pid": os.getpid(), "t": time.time()}
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if kind == "group":
            os.killpg(server.proc.pid, signal.SIGKILL)
        else:
            os.kill(victim, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
        # A stopped server is alive until its hang timeout declares it dead: 10 s after that.
        wait = 10.0 + (HANG_TIMEOUT_S if kind == "stop" else 0)
        threading.Thread(target=left_after, args=(record, log_path.with_name("left.jsonl"), wait),
                         daemon=True).start()

    start = RolloutServer.start

    def start_and_remember(self: RolloutServer) -> None:
        start(self)
        state["server"] = self
    RolloutServer.start = start_and_remember      # type: ignore[method-assign]

    post = RolloutServer.post

    def post_and_kill(self: RolloutServer, path: str, body: Any = None, params: Any = None,
                      timeout: float = 600.0) -> Any:
        method = body.get("method") if path == "/collective_rpc" and body else None
        inject(RPCS.get(method, "") if method else SERVER_CALLS.get(path, ""))
        return post(self, path, body, params, timeout)
    RolloutServer.post = post_and_kill            # type: ignore[method-assign]

    produce = AheadRollouts._produce

    def produce_marked(self: AheadRollouts) -> None:
        PRODUCER.set(True)                        # this thread's context: its to_thread recoveries copy it
        produce(self)
    AheadRollouts._produce = produce_marked       # type: ignore[method-assign]

    reseed = RolloutFleet.reseed

    def reseed_at(self: RolloutFleet, step: int) -> None:
        state["generating"], state["answered"] = step, 0
        reseed(self, step)
    RolloutFleet.reseed = reseed_at               # type: ignore[method-assign]

    learn = loop.learn

    def learn_at(*args: Any, **kwargs: Any) -> Any:
        state["training"] = kwargs["step"] if "step" in kwargs else args[5]
        return learn(*args, **kwargs)
    loop.learn = learn_at                         # looked up by `train` at each step

    client_post = RolloutClient._post

    async def client_post_and_kill(self: RolloutClient, client: Any, path: str, body: dict) -> dict:
        if "prompt_logprobs" in body:
            if state["in_verify"]:
                inject("verify")                  # the verification request meets a dead server
            return await client_post(self, client, path, body)
        if state["outstanding"]:
            # A request of the step is out (sent, not answered) and this one goes out next: the
            # death meets both. (After the first answer, as a fallback for one request at a time:
            # the tiny model answers a step's concurrent requests together, so by the time the
            # first answer is read the others are often read too and the kill met no request.)
            inject("generate")
        state["outstanding"] += 1
        try:
            result = await client_post(self, client, path, body)
        finally:
            state["outstanding"] -= 1
        state["answered"] += 1
        if state["answered"] == 1:
            inject("generate")
        return result
    RolloutClient._post = client_post_and_kill    # type: ignore[method-assign]

    verify = WeightPublisher.verify

    def verify_marked(self: WeightPublisher, *args: Any, **kwargs: Any) -> dict:
        state["in_verify"] = True
        try:
            return verify(self, *args, **kwargs)
        finally:
            state["in_verify"] = False
    WeightPublisher.verify = verify_marked        # type: ignore[method-assign]

    server_diffs = verification.server_diffs

    def server_diffs_marked(*args: Any, **kwargs: Any) -> Any:
        state["in_verify"] = True                 # also a verification overlapped with the next rollout
        try:
            return server_diffs(*args, **kwargs)
        finally:
            state["in_verify"] = False
    verification.server_diffs = server_diffs_marked   # looked up by the publisher at each call

    # The step's log-prob phase, whether or not it runs a π_old forward (on-policy steps take π_old
    # from the update's own forward and compute none).
    logprobs, train_step = Policy.logprobs, Actor.train_step

    def logprobs_and_kill(self: Policy, *args: Any, **kwargs: Any) -> Any:
        inject("logprobs")
        return logprobs(self, *args, **kwargs)

    def train_and_kill(self: Actor, *args: Any, **kwargs: Any) -> Any:
        inject("train")
        return train_step(self, *args, **kwargs)
    Policy.logprobs, Actor.train_step = logprobs_and_kill, train_and_kill   # type: ignore[method-assign]

    # The segments' writes: a dense round's (SegmentWriter) and a delta round's patches, which
    # SharedSegmentTransport writes without calling its base (an injection happens once a step).
    for writer in (SegmentWriter, SharedSegmentTransport):
        def send_and_kill(self: Any, tensors: Any, send: Any = writer.send_bucket) -> None:
            inject("sync_write")
            send(self, tensors)
        writer.send_bucket = send_and_kill        # type: ignore[method-assign]

    save = checkpoint_mod.save_checkpoint

    def save_and_kill(*args: Any, **kwargs: Any) -> Any:
        inject("checkpoint")
        return save(*args, **kwargs)
    checkpoint_mod.save_checkpoint = save_and_kill        # looked up by RunDir.save at each call

    restart = RolloutServer.restart

    def restart_timed(self: RolloutServer) -> None:
        begin = time.time()
        try:
            restart(self)
        finally:
            spent = state["restart_s"]
            spent[threading.get_ident()] = spent.get(threading.get_ident(), 0.0) + time.time() - begin
    RolloutServer.restart = restart_timed         # type: ignore[method-assign]

    recover = ServerSupervisor.recover

    def recover_and_log(self: ServerSupervisor, error: BaseException, phase: str) -> bool:
        # The call met the death here; the restart(s), re-send and check follow.
        failed, token = time.time(), RECOVERING.set(True)
        state["restart_s"][threading.get_ident()] = 0.0
        try:
            restarted = recover(self, error, phase)
        finally:
            RECOVERING.reset(token)
        if restarted:                             # the interrupted call is redone from here
            spent = round(state["restart_s"][threading.get_ident()], 1)
            with open(log_path.with_name("recoveries.jsonl"), "a") as f:
                f.write(json.dumps({"t": time.time(), "failed_t": failed, "restart_s": spent, "phase": phase,
                                    "trainer_pid": os.getpid()}) + "\n")
        return restarted
    ServerSupervisor.recover = recover_and_log    # type: ignore[method-assign]

    train(load_recipe(recipe, overrides), resume=resume)
    server = state["server"]
    with open(log_path.with_name("children.jsonl"), "a") as f:    # what the last injection is checked against
        f.write(json.dumps({"trainer_pid": os.getpid(), "restarts": server.restarts if server else 0}) + "\n")
    return 0


def fault_target(server: Any, kind: str) -> int | None:
    """The pid a fault of `kind` hits: the API process, or the first engine core / worker under it."""
    import psutil

    if kind in ("group", "api", "stop"):
        return int(server.proc.pid)
    name = "VLLM::EngineCore" if kind == "engine" else "VLLM::Worker"
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if p.name().startswith(name):
                return int(p.pid)
        except psutil.Error:
            continue
    return None


def left_after(record: dict[str, Any], out: Path, after_s: float) -> None:
    """Which of the faulted server's processes still live `after_s` after the fault."""
    import psutil

    time.sleep(after_s)
    left = []
    for pid in record["processes"]:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.Error:
            pass
    with open(out, "a") as f:
        f.write(json.dumps({"step": record["step"], "phase": record["phase"], "kind": record["kind"],
                            "after_s": after_s, "left_after_10s": left}) + "\n")


# ---------------------------------------------------------------------------------------- driver
def listeners(pids: set[int]) -> list[str]:
    """Listening TCP sockets of these processes not bound to loopback."""
    import psutil

    bad = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "::1"):
                bad.append(f"pid {pid} {c.laddr.ip}:{c.laddr.port}")
    return bad


def tree(root: int) -> set[int]:
    import psutil

    try:
        p = psutil.Process(root)
        return {root} | {c.pid for c in p.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def server_pids(run: Path) -> set[int]:
    """The rollout server's group (its own session, so not under the trainer's tree after a restart);
    the colocated server of node 0 publishes under `<run>/rollout/node_0/rollout/` (train/fleet.py
    `node_dir`; not imported: the driver stays free of torch)."""
    import psutil

    try:
        pid = json.loads((run / "rollout" / "node_0" / "rollout" / "server.json").read_text())["pid"]
        return tree(pid) if psutil.pid_exists(pid) else set()
    except (OSError, ValueError, KeyError):
        return set()


def launch(args: argparse.Namespace, run_name: str, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps), "--seed", str(args.seed),
           "--max-staleness", str(args.max_staleness), "--out", str(args.out), "--kinds", ",".join(args.kinds),
           "--phases", ",".join(args.phases), "--tp", str(args.tp), "--run-name", run_name] \
        + (["--resume"] if resume else []) + (["--delta"] if args.delta else [])
    log = open(args.out / f"{run_name}.{'resumed' if resume else 'first'}.log", "w")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if set(args.kinds) - {"group"}:
        # vLLM's own layout (an engine core and workers beside the API process, as on a GPU) even for
        # one rank on CPU, which otherwise runs in the API process: the faults of one process need it.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def watch(proc: subprocess.Popen, run: Path, seen_bad: set[str], kill_at_step: int | None) -> bool:
    """Wait for the child; with `kill_at_step`, SIGKILL the trainer's group once that step is logged
    (after the checkpoint before it). Returns whether the trainer was killed."""
    metrics = run / "metrics.jsonl"
    while proc.poll() is None:
        seen_bad.update(listeners(tree(proc.pid) | server_pids(run)))
        if kill_at_step is not None and metrics.is_file():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]
            if steps and max(steps) >= kill_at_step:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return True
        time.sleep(0.5)
    return False


def driver(args: argparse.Namespace) -> dict[str, Any]:
    from bench._report import emit
    from megatron_rl.train.health import verdict  # stdlib and yaml only

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    run_name = f"faults-{int(time.time())}" + (f"-async{args.max_staleness}" if args.max_staleness else "")
    run = args.out / run_name
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    bad: set[str] = set()
    kill_at = SAVE_INTERVAL + 2                     # two steps past the checkpoint: they are redone
    first = launch(args, run_name, resume=False)
    killed = watch(first, run, bad, kill_at)
    rc_first = first.returncode
    second = launch(args, run_name, resume=True) if killed else None
    if second is not None:
        watch(second, run, bad, None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    counts = Counter(r["step"] for r in rows)
    injections = _jsonl(run / "injections.jsonl")
    logs = [p.read_text(errors="replace") for p in sorted(args.out.glob(f"{run_name}.*.log"))]
    # The run finished: the resumed trainer exited 0, or, in a run too short for the trainer kill
    # (steps <= the kill step), its only trainer did.
    finished = run_finished(rc_first, second.returncode if second is not None else None, killed)
    survived = sum(1 for i in injections if _survived(i, rows, finished, killed))
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    out = {
        "max_staleness": args.max_staleness,
        "injected": len(injections) + (1 if killed else 0),
        "survived": survived + (1 if killed and finished else 0),
        "steps_lost": sorted(set(range(1, args.steps + 1)) - set(counts)),
        "steps_duplicated": sorted(s for s, c in counts.items() if c > 1),
        "kinds": list(args.kinds), "rollout_tp": args.tp,
        "partial_fault_phases": list(args.phases),
        "never_reached": never_reached(schedule(args.steps, args.seed, args.kinds, args.phases), injections,
                                       max(counts, default=0)),
        "not_met": not_met(injections, _jsonl(run / "children.jsonl"), first.pid if killed else None),
        "weight_version_is_step_plus_1": all(r["weight_version"] == r["step"] + 1 for r in rows),
        "server_kills_by_phase": dict(Counter(i["phase"] for i in injections)),
        "trainer_killed_after_step": kill_at if killed else None,
        "first_exit_code": rc_first, "resumed_exit_code": second.returncode if second is not None else None,
        "restarts_logged": sum(log.count("[rollout] server down") for log in logs),
        "restarts_failed_and_retried": sum(log.count("[rollout] restart failed") for log in logs),
        "restarts_verified_numerically": sum(log.count("verified: max |Δ log-prob|") for log in logs),
        "health": verdict(rows),
        "delta": args.delta, "sync_rounds": sync_rounds(rows),
        **recovery_report(injections, _jsonl(run / "recoveries.jsonl")),
        "left_after_10s": [r for r in _jsonl(run / "left.jsonl") if r["left_after_10s"]],
        "processes_left": processes_left(injections),
        "ports_left": sorted({i["port"] for i in injections if not port_binds(i["port"])}),
        "non_loopback_listeners": sorted(bad),
        "shm_left": shm_left(shm_after - shm_before),
        "tmp_left": tmp_left(set(os.listdir(tempfile.gettempdir())) - tmp_before),
        "run_dir": str(run),
    }
    emit(out, started, args.json_out)
    return out


def recovery_report(injections: list[dict[str, Any]], recoveries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per fault, the seconds from it to the run going on (`s`: the supervisor's restart done and
    checked, the interrupted call about to be redone), of which `failed_after_s` until the call
    met the death (the supervisor called) and `restart_s` in the server's restarts (stop, start to
    healthy); the worst per kind, and the faults over 60 s or never recovered (the SIGKILLed
    trainer's last fault, whose step the resumed run redoes, has none)."""
    seconds: list[dict[str, Any]] = []
    for i in injections:
        after = [r for r in recoveries if r["trainer_pid"] == i["trainer_pid"] and r["t"] >= i["t"]]
        first = min(after, key=lambda r: r["t"]) if after else None
        failed = first.get("failed_t") if first else None
        seconds.append({"step": i["step"], "phase": i["phase"], "kind": i.get("kind", "group"),
                        "s": round(first["t"] - i["t"], 1) if first else None,
                        "failed_after_s": round(max(0.0, failed - i["t"]), 1) if failed is not None else None,
                        "restart_s": first.get("restart_s") if first else None})
    timed = [x for x in seconds if x["s"] is not None]
    by_kind: dict[str, float] = {}
    for x in timed:
        by_kind[x["kind"]] = max(by_kind.get(x["kind"], 0.0), x["s"])
    worst = max(timed, key=lambda x: x["s"], default=None)
    return {"recovery_s_worst": worst, "recovery_s_worst_by_kind": by_kind,
            "failed_after_s_worst": max((x["failed_after_s"] for x in timed if x["failed_after_s"] is not None),
                                        default=None),
            "recoveries": seconds,
            "recovery_over_60s": [x for x in timed if x["s"] > 60],
            "never_recovered": [x for x in seconds if x["s"] is None]}


def processes_left(injections: list[dict[str, Any]]) -> list[int]:
    """Processes of faulted servers still alive at the end (every trainer has exited by then)."""
    import psutil

    left = set()
    for i in injections:
        for pid in i.get("processes", []):
            try:
                if psutil.Process(pid).create_time() <= i["t"] and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.add(pid)
            except psutil.Error:
                pass
    return sorted(left)


def port_binds(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def run_finished(rc_first: int | None, rc_resumed: int | None, killed: bool) -> bool:
    """Whether the run got to its end: through the resumed trainer when the first was killed."""
    return rc_resumed == 0 if killed else rc_first == 0


def _survived(injection: dict[str, Any], rows: list[dict[str, Any]], finished: bool, killed: bool) -> bool:
    """The run went on past the fault: the step it hit was logged afterwards and the run finished."""
    return finished and any(r["step"] >= injection["step"] for r in rows)


def never_reached(plan: dict[int, list[str]], injections: list[dict[str, Any]], last_step: int) -> list[str]:
    """Planned kills (of the steps the run got to) that no trainer process ever reached: the phase
    was renamed or moved and the bench's hook no longer fires."""
    hit = {(i["step"], i["phase"] if i.get("kind", "group") == "group" else f"{i['phase']}@{i['kind']}")
           for i in injections}
    return [f"step {step}: {phase}" for step, phases in sorted(plan.items()) if step <= last_step
            for phase in phases if (step, phase) not in hit]


def not_met(injections: list[dict[str, Any]], children: list[dict[str, Any]], killed_pid: int | None) -> list[str]:
    """Kills after which the trainer never restarted the server (it did not notice the death). The
    server's restart count is logged at each kill and when a trainer finishes; the last kill of the
    trainer that was SIGKILLed itself is exempt (its step is redone by the resumed run)."""
    final = {c["trainer_pid"]: c["restarts"] for c in children}
    bad = []
    for pid in sorted({i["trainer_pid"] for i in injections}):
        mine = [i for i in injections if i["trainer_pid"] == pid]
        later = [i["restarts"] for i in mine[1:]] + [final.get(pid)]
        for i, after in zip(mine, later):
            if after is None and pid == killed_pid:
                continue
            if after is None or after <= i["restarts"]:
                bad.append(f"step {i['step']}: {i['phase']} (trainer {pid})")
    return bad


def shm_left(new: set[str]) -> list[str]:
    """/dev/shm files that appeared during the run and that no live process uses or, for sync
    directories, owns (on a shared host other runs' trainers and servers create and use such files
    meanwhile: those are not leftovers; every process of this run has exited by now)."""
    from megatron_rl.rollout import shm  # stdlib only: the driver stays free of torch

    mapped = shm.mapped_paths()
    return sorted(n for n in new if n.startswith((shm.SYNC_PREFIX, *shm.VLLM_PREFIXES))
                  and (shm.SHM / n).exists() and not shm.in_use(shm.SHM / n, mapped) and not shm.creator_alive(n))


def async_overrides(max_staleness: int) -> list[str]:
    """The recipe keys of the asynchronous run (none for the synchronous one); the correction is the
    default's, token-level TIS with staleness."""
    if not max_staleness:
        return []
    return [f"rollout.max_staleness={max_staleness}", "rollout.placement=disaggregated", "rollout.nodes=1"]


def tmp_left(new: set[str]) -> list[str]:
    """Server temp directories (and vLLM rendezvous files) that appeared during the run and are
    still there, of no live process: each server's is removed when it stops, is restarted, or is
    orphaned."""
    from megatron_rl.rollout import shm

    return sorted(n for n in new if n.startswith((shm.SERVER_TMP_PREFIX, "vllm_dist_")) and not shm.creator_alive(n))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`argv`, default sys.argv): what `driver` takes (tests/integration builds
    its run from it too)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="default: enough for every fault once (20 for --kinds group)")
    ap.add_argument("--kinds", default="group", help=f"comma-separated fault kinds of {','.join(KINDS)} (see KINDS)")
    ap.add_argument("--phases", default=",".join(PARTIAL_PHASES),
                    help="where the faults other than group are injected (default: every request phase)")
    ap.add_argument("--tp", type=int, default=1, help="the rollout server's tensor_parallel_size (2: --kinds worker "
                                                        "kills one worker of two)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "faults")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--max-staleness", type=int, default=0,
                    help="0: the synchronous loop; k >= 1: asynchronous rollout, k versions ahead")
    ap.add_argument("--delta", action="store_true",
                    help="the run in bf16 at lr 1e-6 with rollout.sync_delta on, so that its syncs are sparse "
                         "patches (`sync/delta.py`; in fp32 at the tiny recipe's lr every element changes and each "
                         "tensor goes whole); synchronous loop only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-name", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    args.kinds = tuple(k for k in args.kinds.split(",") if k)
    if not args.kinds or set(args.kinds) - set(KINDS):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}")
    args.phases = tuple(p for p in args.phases.split(",") if p)
    if not args.phases or set(args.phases) - set(PARTIAL_PHASES):
        ap.error(f"--phases: choose from {', '.join(PARTIAL_PHASES)}")
    args.steps = args.steps or max(20 if "group" in args.kinds else 0, steps_needed(args.kinds, args.phases))
    return args


def child_overrides(args: argparse.Namespace) -> list[str]:
    """The trainer's recipe overrides: the demo's assets wherever they are built ($MEGATRON_RL_CACHE),
    the small batch, the plan's steps, the run dir."""
    from megatron_rl.commands.demo import asset_overrides

    return asset_overrides() + [
        f"trainer.max_steps={args.steps}", f"checkpoint.save_interval={SAVE_INTERVAL}",
        f"logging.output_dir={args.out}", f"logging.run_name={args.run_name}", "logging.tensorboard=false",
        f"rollout.tensor_parallel_size={args.tp}"] \
        + ([f"rollout.hang_timeout_s={HANG_TIMEOUT_S}"] if "stop" in args.kinds else []) \
        + async_overrides(args.max_staleness) + (DELTA_OVERRIDES if args.delta else [])


DELTA_OVERRIDES = ["model.params_dtype=bf16", "rollout.dtype=bfloat16", "trainer.lr=1e-6", "rollout.sync_delta=on"]
"""`--delta`: bf16 at an RL learning rate, where an optimizer step changes ~1 % of the stored values."""


def sync_rounds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's syncs as the metrics log has them: how many went as deltas and whole, and the deltas'
    median changed fraction and bytes (`sync/*`)."""
    deltas = [r for r in rows if r.get("sync/dense") == 0]

    def median(key: str) -> float | None:
        values = [r[key] for r in deltas if key in r]
        return statistics.median(values) if values else None
    return {"delta": len(deltas), "dense": sum(1 for r in rows if r.get("sync/dense") == 1),
            "delta_changed_frac_median": median("sync/changed_frac"), "delta_bytes_median": median("sync/bytes")}


def passed(result: dict[str, Any]) -> bool:
    """Every fault survived, nothing lost or twice, every planned fault hit and noticed, a healthy
    model, every recovery under 60 s, nothing of a faulted server left; with --delta, delta syncs sent."""
    return result["survived"] == result["injected"] and not result["steps_lost"] and not result["steps_duplicated"] \
        and not result["never_reached"] and not result["not_met"] and not result["health"]["collapsed"] \
        and not result["recovery_over_60s"] \
        and not result["processes_left"] and not result["ports_left"] and not result["left_after_10s"] \
        and not result["shm_left"] and not result["tmp_left"] \
        and (not result.get("delta") or result["sync_rounds"]["delta"] > 0)      # --delta: deltas were sent


def main() -> None:
    args = parse()
    if args.child:
        sys.exit(child(str(REPO / "recipes" / "tiny" / "grpo.yaml"), child_overrides(args),
                       schedule(args.steps, args.seed, args.kinds, args.phases),
                       args.out / args.run_name / "injections.jsonl",
                       args.resume))
    result = driver(args)
    for key in ("never_reached", "not_met"):
        if result[key]:
            print(f"FAULT INJECTION BROKEN: {key}: {result[key]}", file=sys.stderr)
    sys.exit(0 if passed(result) else 1)


if __name__ == "__main__":
    main()
