"""Fault-injection run: a tiny GRPO run whose rollout server is SIGKILLed (its whole process group)
at a chosen moment of many steps, covering every phase, plus one SIGKILL of the trainer followed
by `--resume`. Prints JSON: faults injected / survived, steps lost / logged twice, the listening
sockets seen during the run that were not on loopback, and /dev/shm files left behind.

    python bench/faults.py [--steps 24] [--seed 0] [--out DIR] [--json-out FILE]

The trainer runs in a child process (`--child`) that wraps a few functions to know which phase it
is in and kills the real server there; nothing is mocked. Phases: the per-step reseed, mid-
generation (after the first answered request), the post-sync verification request, each call of
the weight sync (pause, update, prefix-cache reset, resume), and the moments the server is idle
(the trainer computing log-probs, training, writing the sync segments, saving a checkpoint: the
death is met at the next call). Each server restart costs ~30 s here, so a run takes ~15 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("reseed", "generate", "verify", "pause", "update", "reset", "resume",
          "logprobs", "train", "sync_write", "checkpoint")
SAVE_INTERVAL = 4
SMALL = ["trainer.global_batch_size=16", "rollout.n=4", "trainer.micro_batch_size=4"]


def schedule(steps: int, seed: int) -> dict[int, str]:
    """One injection per step, every phase at least twice when steps allow; checkpoint faults only
    at steps that save."""
    rng = random.Random(seed)
    plan: dict[int, str] = {}
    pool: list[str] = []
    for step in range(1, steps + 1):
        if not pool:
            pool = [p for p in PHASES if p != "checkpoint"]
            rng.shuffle(pool)
        plan[step] = "checkpoint" if step % SAVE_INTERVAL == 0 and step // SAVE_INTERVAL % 2 == 1 else pool.pop()
    return plan


# ---------------------------------------------------------------------------------------- child
def child(recipe: str, overrides: list[str], plan: dict[int, str], log_path: Path, resume: bool) -> int:
    """Run `train` with the plan's kills wired in (this process only: the server stays real)."""
    import megatron_rl.megatron.checkpoint as ckpt
    import megatron_rl.train.checkpointing as checkpointing_mod
    import megatron_rl.train.session as session_mod
    import megatron_rl.train.sync_phase as sync_phase_mod
    from megatron_rl.config import load_recipe
    from megatron_rl.megatron.actor import Actor
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.server import RolloutServer
    from megatron_rl.train.loop import train
    from megatron_rl.weights.transport_file import FileTransport

    state: dict[str, Any] = {"step": 0, "server": None, "done": set(), "in_verify": False, "answered": 0}

    def inject(phase: str) -> None:
        key = (state["step"], phase)
        server = state["server"]
        if plan.get(state["step"]) != phase or key in state["done"] or server is None or server.proc is None:
            return
        state["done"].add(key)
        with open(log_path, "a") as f:
            f.write(json.dumps({"step": state["step"], "phase": phase, "pid": server.proc.pid,
                                "trainer_pid": os.getpid(), "t": time.time()}) + "\n")
        os.killpg(server.proc.pid, signal.SIGKILL)

    start = RolloutServer.start

    def start_and_remember(self: RolloutServer) -> None:
        start(self)
        state["server"] = self
    RolloutServer.start = start_and_remember

    post = RolloutServer.post
    paths = {"/pause": "pause", "/reset_prefix_cache": "reset", "/resume": "resume"}

    def post_and_kill(self: RolloutServer, path: str, body: Any = None, params: Any = None,
                      timeout: float = 600.0) -> Any:
        method = body.get("method") if path == "/collective_rpc" and body else None
        inject({"mrl_reseed": "reseed", "mrl_update": "update"}.get(method, paths.get(path, "")))
        return post(self, path, body, params, timeout)
    RolloutServer.post = post_and_kill

    reseed = session_mod.Session.reseed_servers

    def reseed_at(self: Any, step: int) -> None:
        state["step"], state["answered"] = step, 0
        reseed(self, step)
    session_mod.Session.reseed_servers = reseed_at

    client_post = RolloutClient._post

    async def client_post_and_kill(self: RolloutClient, client: Any, path: str, body: dict) -> dict:
        result = await client_post(self, client, path, body)
        if "prompt_logprobs" not in body:
            state["answered"] += 1
            if state["answered"] == 1:
                inject("generate")
        return result
    RolloutClient._post = client_post_and_kill

    verify = sync_phase_mod.verify

    def verify_and_kill(session: Any, probe: Any, version: int) -> dict:
        state["in_verify"] = True
        try:
            inject("verify")
            return verify(session, probe, version)
        finally:
            state["in_verify"] = False
    sync_phase_mod.verify = verify_and_kill

    logprobs, train_step = Actor.compute_logprobs, Actor.train_step

    def logprobs_and_kill(self: Actor, *args: Any, **kwargs: Any) -> Any:
        if not state["in_verify"]:
            inject("logprobs")
        return logprobs(self, *args, **kwargs)

    def train_and_kill(self: Actor, *args: Any, **kwargs: Any) -> Any:
        inject("train")
        return train_step(self, *args, **kwargs)
    Actor.compute_logprobs, Actor.train_step = logprobs_and_kill, train_and_kill

    send = FileTransport.send_bucket

    def send_and_kill(self: FileTransport, tensors: Any) -> None:
        inject("sync_write")
        send(self, tensors)
    FileTransport.send_bucket = send_and_kill

    save = ckpt.save_checkpoint

    def save_and_kill(*args: Any, **kwargs: Any) -> Any:
        inject("checkpoint")
        return save(*args, **kwargs)
    checkpointing_mod.save_checkpoint = save_and_kill

    train(load_recipe(recipe, overrides), resume=resume)
    return 0


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
    """The rollout server's group (its own session, so not under the trainer's tree after a restart)."""
    import psutil

    try:
        pid = json.loads((run / "rollout" / "server.json").read_text())["pid"]
        return tree(pid) if psutil.pid_exists(pid) else set()
    except (OSError, ValueError, KeyError):
        return set()


def launch(args: argparse.Namespace, run_name: str, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps), "--seed", str(args.seed),
           "--out", str(args.out), "--run-name", run_name] + (["--resume"] if resume else [])
    log = open(args.out / f"{run_name}.{'resumed' if resume else 'first'}.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))


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

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    run_name = f"faults-{int(time.time())}"
    run = args.out / run_name
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
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
    injections = [json.loads(line) for line in (run / "injections.jsonl").read_text().splitlines()]
    logs = [p.read_text(errors="replace") for p in sorted(args.out.glob(f"{run_name}.*.log"))]
    finished = second is not None and second.returncode == 0
    survived = sum(1 for i in injections if _survived(i, rows, finished, killed))
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    out = {
        "injected": len(injections) + (1 if killed else 0),
        "survived": survived + (1 if killed and finished else 0),
        "steps_lost": sorted(set(range(1, args.steps + 1)) - set(counts)),
        "steps_duplicated": sorted(s for s, c in counts.items() if c > 1),
        "weight_version_is_step_plus_1": all(r["weight_version"] == r["step"] + 1 for r in rows),
        "server_kills_by_phase": dict(Counter(i["phase"] for i in injections)),
        "trainer_killed_after_step": kill_at if killed else None,
        "first_exit_code": rc_first, "resumed_exit_code": second.returncode if second is not None else None,
        "restarts_logged": sum(log.count("[rollout] server down") for log in logs),
        "restarts_verified_numerically": sum(log.count("verified: max |Δ log-prob|") for log in logs),
        "non_loopback_listeners": sorted(bad),
        "shm_left": sorted(n for n in shm_after - shm_before if n.startswith(("megatron-rl-sync-", "psm_", "sem.mp-"))),
        "run_dir": str(run),
    }
    emit(out, started, args.json_out)
    return out


def _survived(injection: dict[str, Any], rows: list[dict[str, Any]], finished: bool, killed: bool) -> bool:
    """The run went on past the fault: the step it hit was logged afterwards and the run finished."""
    return finished and any(r["step"] >= injection["step"] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "faults")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-name", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out = args.out.resolve()
    if args.child:
        overrides = SMALL + [f"trainer.max_steps={args.steps}", f"checkpoint.save_interval={SAVE_INTERVAL}",
                             f"logging.output_dir={args.out}", f"logging.run_name={args.run_name}",
                             "logging.tensorboard=false"]
        sys.exit(child(str(REPO / "recipes" / "tiny" / "grpo.yaml"), overrides, schedule(args.steps, args.seed),
                       args.out / args.run_name / "injections.jsonl", args.resume))
    result = driver(args)
    ok = result["survived"] == result["injected"] and not result["steps_lost"] and not result["steps_duplicated"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
