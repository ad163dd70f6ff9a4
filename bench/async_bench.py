"""Asynchronous rollout against the synchronous loop on the same two cores: the tiny GRPO recipe with
one external (disaggregated) rollout server, run with `rollout.max_staleness` 0 (generate, then
train, then sync: today's loop) and 1 (the server generates the next step's batch while the trainer
trains), one after the other in one invocation. Prints one JSON object (also to --json-out).

    .venv/bin/python bench/async_bench.py [--steps 80] [--seed 1234] [--out runs/async_bench]
        [--json-out FILE] [--recipe recipes/tiny/grpo.yaml] [--modes sync,async]
        [--server-cpus 0] [--trainer-cpus 1] [--set key=value ...] [--timeout-s 3600]

Both modes get the same layout: a fresh `megatron-rl rollout-server` process (vLLM) pinned to
--server-cpus, and `megatron-rl train RECIPE rollout.placement=disaggregated rollout.nodes=1`
attached to it through $MEGATRON_RL_ROLLOUT_SERVERS, pinned to --trainer-cpus; OMP_NUM_THREADS=1
for both, and every child inherits its parent's pin. Once a mode's first step is logged, the CPUs
every thread of both process trees may run on are read back (`affinity`: what was in force, not only
what was asked). Same recipe, seed (`trainer.seed`) and steps (`trainer.max_steps`) in both; a
fresh server for each mode (the trainer's start-up verification expects it to hold the initial
checkpoint), stopped after its mode, also on an error, SIGTERM or Ctrl-C.

Throughput (`throughput_measure`): metrics.jsonl rows carry no wall-clock time, so the bench polls
the file every 0.1 s and stamps each step's row when it appears. steps/s = (last step − first
step) / (time the last row appeared − time the first row appeared): start-up (model build, server
attach, first verification) and the first step (in async mode: the pipeline filling) are left out,
everything after is in (rollout, training, weight syncs, the periodic eval, all waiting). A sum of
`time/step` counts only the timed phases, and with rollouts overlapping training it no longer adds
up to the wall clock; it is reported per mode for reference (`modes.<mode>.time_step_sum_s`).

How to read the JSON:
- `speedup` = async_steps_per_s / sync_steps_per_s; the issue's goal is `goal_speedup` (1.3).
- `*_reward_first10` / `*_reward_last10`: mean of `reward/mean` over steps 1-10 and the last 10
  logged steps. `reward_noise` = the sync run's standard error over its last 10 steps (sample std
  / √n); `end_reward_within_noise`: |async_last10 − sync_last10| ≤ 2 × √(se_sync² + se_async²)
  (`end_reward_diff`, `end_reward_combined_se`). `goal_met` = speedup ≥ 1.3 and within noise and
  both runs healthy; `goal_reason` says which part failed (null when met).
- Health (`train/health.py`): `modes.<mode>.health` is the run's verdict from its `health/*`
  metrics (`collapsed`, the first collapsed step, the longest streak, the signals) and
  `health_stop`, the trainer's stop line when it stopped itself. A collapsed side is never a
  result: a dead model generating to the length cap is not a speed (`sync_healthy`, `async_healthy`).
- Async health: `staleness_mean` (mean over steps of `rollout/staleness_mean`), `staleness_max`
  (max of `rollout/staleness_max`), `dropped_stale` (sum of `rollout/dropped_stale`).
- Waits, means per step: `*_trainer_wait_s` (`time/trainer_wait_s`, the trainer waited for
  rollouts), `*_rollout_wait_s` (`time/rollout_wait_s`, the server sat idle); null where the
  run did not log them (the synchronous loop may not).
- `png`: both reward curves (per step, faint, and a 10-step rolling mean) in one figure.
- `modes.<mode>`: each run's own record: exit codes, steps logged, start-up and wall times, log
  files, overrides, whether anything of its server was left running.
Exit code 1 when a run failed or logged fewer steps than asked (but for a stop by its health), 130
when interrupted; a missed goal is a result (exit 0). Each server start costs 25-60 s on the shared
2-core VM, by load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl.rollout.affinity import format_cpu_list, parse_cpu_list  # noqa: E402  (stdlib only)
from megatron_rl.rollout.shm import wait_group_gone  # noqa: E402  (stdlib only)
from megatron_rl.train.health import verdict  # noqa: E402  (stdlib and yaml only)

SERVERS_ENV = "MEGATRON_RL_ROLLOUT_SERVERS"
"""rollout/server.py `EXTERNAL_SERVERS_ENV` (not imported: that module imports torch; a unit test
holds the two equal)."""
DISAGGREGATED = ["rollout.placement=disaggregated", "rollout.nodes=1"]
MODES: dict[str, list[str]] = {"sync": [], "async": ["rollout.max_staleness=1"]}
"""Each mode's own overrides; sync keeps the default `rollout.max_staleness: 0`."""
GOAL_SPEEDUP = 1.3
WINDOW = 10
POLL_S = 0.1
REWARD, STALENESS_MEAN, STALENESS_MAX, DROPPED = ("reward/mean", "rollout/staleness_mean", "rollout/staleness_max",
                                                  "rollout/dropped_stale")
TRAINER_WAIT, ROLLOUT_WAIT, STEP_TIME = "time/trainer_wait_s", "time/rollout_wait_s", "time/step"
THROUGHPUT_MEASURE = ("wall clock between the appearance of the first and the last step's row in metrics.jsonl "
                      "(polled every 0.1 s): (last_step - first_step) / seconds; start-up and step 1 excluded")


# ------------------------------------------------------------------------------------ summary
def _mean(values: list[float]) -> float | None:
    return float(statistics.fmean(values)) if values else None


def _se(values: list[float]) -> float | None:
    """Standard error of the mean (sample std / √n); None under two values."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) >= 2 else None


def _column(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def mode_stats(rows: list[dict[str, Any]], arrivals: dict[int, float]) -> dict[str, Any]:
    """One run's numbers from its metrics rows and the time each step's row appeared (seconds, any
    origin): steady steps/s, the reward windows, staleness, the waits (means per step)."""
    rows = sorted(rows, key=lambda r: r["step"])
    rewards = _column(rows, REWARD)
    last = rewards[-WINDOW:]
    seen = sorted(arrivals.items())
    span = seen[-1][1] - seen[0][1] if len(seen) >= 2 else 0.0
    max_stale = _column(rows, STALENESS_MAX)
    dropped = _column(rows, DROPPED)
    return {
        "steps_logged": len(rows),
        "steps_per_s": (seen[-1][0] - seen[0][0]) / span if span > 0 else None,
        "steady_wall_s": span,
        "time_step_sum_s": sum(_column(rows, STEP_TIME)),
        "reward_first10": _mean(_column([r for r in rows if r["step"] <= WINDOW], REWARD)),
        "reward_last10": _mean(last),
        "reward_last10_se": _se(last),
        "reward_curve": [(r["step"], float(r[REWARD])) for r in rows if r.get(REWARD) is not None],
        "staleness_mean": _mean(_column(rows, STALENESS_MEAN)),
        "staleness_max": max(max_stale) if max_stale else None,
        "dropped_stale": sum(dropped) if dropped else None,
        "trainer_wait_s": _mean(_column(rows, TRAINER_WAIT)),
        "rollout_wait_s": _mean(_column(rows, ROLLOUT_WAIT)),
        "health": verdict(rows),
    }


def healthy(m: dict[str, Any]) -> bool | None:
    """Whether a mode's run stayed healthy: no collapsed step, no stop line (None: it did not run)."""
    if "health" not in m:
        return None
    return not m["health"]["collapsed"] and not m.get("health_stop")


def collapse_reason(mode: str, m: dict[str, Any]) -> str:
    """Why a mode's run is no result: its trainer's stop line, else its collapsed steps."""
    if m.get("health_stop"):
        return f"{mode} run collapsed ({m['health_stop']})"
    h = m["health"]
    return (f"{mode} run collapsed at step {h['first_collapsed_step']} (longest streak "
            f"{h['collapsed_steps_in_a_row']} step(s): {', '.join(h['signals'])})")


def goal(speedup: float | None, within: bool | None, health: dict[str, bool | None],
         stats: dict[str, dict[str, Any]]) -> tuple[bool | None, str | None]:
    """`goal_met` and, when it is not met, why: a collapsed side first, then speed and reward."""
    reasons = [collapse_reason(mode, stats[mode]) for mode, ok in health.items() if ok is False]
    if reasons:
        return False, "; ".join(reasons)
    if speedup is None or within is None:
        return None, "a mode did not run or logged too few steps to measure"
    reasons = ([f"speedup {speedup:.2f} < {GOAL_SPEEDUP}"] if speedup < GOAL_SPEEDUP else []) + \
        ([] if within else ["async end reward not within noise of the sync one"])
    return not reasons, "; ".join(reasons) or None


def summarize(stats: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    """The headline keys from the modes' `mode_stats` (a mode that did not run gives nulls)."""
    s, a = stats.get("sync", {}), stats.get("async", {})
    sync_rate, async_rate = s.get("steps_per_s"), a.get("steps_per_s")
    speedup = async_rate / sync_rate if sync_rate and async_rate else None
    diff = combined = within = None
    if s.get("reward_last10") is not None and a.get("reward_last10") is not None:
        diff = a["reward_last10"] - s["reward_last10"]
        if s.get("reward_last10_se") is not None and a.get("reward_last10_se") is not None:
            combined = math.sqrt(s["reward_last10_se"] ** 2 + a["reward_last10_se"] ** 2)
            within = abs(diff) <= 2 * combined
    out: dict[str, Any] = {"steps": steps, "sync_steps_per_s": sync_rate, "async_steps_per_s": async_rate,
                           "speedup": speedup}
    for mode, m in (("sync", s), ("async", a)):
        out[f"{mode}_reward_first10"] = m.get("reward_first10")
        out[f"{mode}_reward_last10"] = m.get("reward_last10")
    out.update({"reward_noise": s.get("reward_last10_se"), "end_reward_diff": diff,
                "end_reward_combined_se": combined, "end_reward_within_noise": within,
                "staleness_mean": a.get("staleness_mean"), "staleness_max": a.get("staleness_max"),
                "dropped_stale": a.get("dropped_stale")})
    for mode, m in (("sync", s), ("async", a)):
        out[f"{mode}_trainer_wait_s"] = m.get("trainer_wait_s")
        out[f"{mode}_rollout_wait_s"] = m.get("rollout_wait_s")
    health = {mode: healthy(m) for mode, m in (("sync", s), ("async", a))}
    out.update({f"{mode}_healthy": ok for mode, ok in health.items()})
    out["goal_speedup"] = GOAL_SPEEDUP
    out["goal_met"], out["goal_reason"] = goal(speedup, within, health, {"sync": s, "async": a})
    return out


def plot(curves: dict[str, list[tuple[int, float]]], path: Path, title: str) -> Path:
    """Every mode's per-step `reward/mean` (faint) and its rolling mean, in one figure; `curves`:
    mode → (step, reward) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_rl.commands.demo import rolling_mean

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (mode, curve) in enumerate(curves.items()):
        steps, rewards = [s for s, _ in curve], [v for _, v in curve]
        color = f"C{i}"
        ax.plot(steps, rewards, color=color, alpha=0.3, label=f"{mode}: reward (mean)")
        ax.plot(steps, rolling_mean(rewards, WINDOW), color=color, label=f"{mode}: {WINDOW}-step rolling mean")
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean")
    ax.legend(fontsize="small")
    ax.set_title(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------- processes
def pinned(cpus: set[int]) -> Callable[[], None]:
    """preexec_fn: this CPU set for the child (and, inherited, everything it starts)."""
    return lambda: os.sched_setaffinity(0, cpus)


def end_group(pgid: int, sig: int = signal.SIGTERM, grace_s: float = 15.0) -> None:
    """`sig` to the process group, then SIGKILL if anything of it is left after `grace_s`."""
    for s, wait in ((sig, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, s)
        except ProcessLookupError:
            return
        if wait_group_gone(pgid, wait):
            return


def launch(cmd: list[str], cpus: set[int], log: Path, extra_env: dict[str, str]) -> subprocess.Popen:
    """A child in its own session (a process group of its own), pinned, output to `log`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra_env)
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=pinned(cpus))


def wait_server(proc: subprocess.Popen, node_dir: Path, timeout_s: float) -> None:
    """Until the server has published itself (server.json is written once /health answers)."""
    published = node_dir / "rollout" / "server.json"
    deadline = time.monotonic() + timeout_s
    while not published.is_file():
        if proc.poll() is not None:
            raise RuntimeError(f"rollout server exited with code {proc.returncode} while starting; "
                               f"see its log and {node_dir / 'rollout' / 'server.log'}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"rollout server not published after {timeout_s:.0f}s; see its log")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, node_dir: Path) -> bool:
    """SIGINT to the CLI (its `finally` stops vLLM's own process group), then SIGTERM/SIGKILL of the
    CLI's group and of vLLM's published group for whatever is left. Returns whether any survived."""
    try:
        vllm_pgid: int | None = json.loads((node_dir / "rollout" / "server.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        vllm_pgid = None
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            end_group(proc.pid)
    end_group(proc.pid)
    proc.wait()
    if vllm_pgid is not None:
        end_group(vllm_pgid)
    return not wait_group_gone(proc.pid, 0) or (vllm_pgid is not None and not wait_group_gone(vllm_pgid, 0))


def tree_affinity(pid: int) -> dict[str, Any]:
    """The CPUs every thread of `pid` and its descendants may run on (union), and how many there are."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return {"cpus": None, "processes": 0, "threads": 0}
    cpus: set[int] = set()
    threads = 0
    for p in procs:
        try:
            tids = [t.id for t in p.threads()]
        except psutil.NoSuchProcess:
            continue
        for tid in tids:
            try:
                cpus |= os.sched_getaffinity(tid)
                threads += 1
            except OSError:
                pass                    # the thread ended meanwhile
    return {"cpus": format_cpu_list(cpus), "processes": len(procs), "threads": threads}


# --------------------------------------------------------------------------------------- a mode
class MetricsFollower:
    """Reads metrics.jsonl as it grows and stamps each step's row (time.perf_counter()) on sight."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.buffer = path, 0, b""
        self.rows: list[dict[str, Any]] = []
        self.arrivals: dict[int, float] = {}

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        now = time.perf_counter()
        self.offset += len(data)
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        for line in lines:
            if line.strip():
                row = json.loads(line)
                self.rows.append(row)
                self.arrivals.setdefault(row["step"], now)


def follow_trainer(proc: subprocess.Popen, follower: MetricsFollower, timeout_s: float,
                   on_first_row: Callable[[], None]) -> None:
    """Poll the trainer's metrics until it exits; `on_first_row` once, when step rows start."""
    deadline = time.monotonic() + timeout_s
    fired = False
    while True:
        done = proc.poll() is not None
        follower.poll()
        if follower.rows and not fired:
            fired = True
            on_first_row()
        if done:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"trainer still running after {timeout_s:.0f}s")
        time.sleep(POLL_S)


def health_stop(log: str) -> str | None:
    """The trainer's stop line when its run health stopped it (`train/health.py`, exit status 1)."""
    lines = [line for line in log.splitlines() if line.startswith("error: the run collapsed at step")]
    return lines[-1].removeprefix("error: ") if lines else None


def run_mode(args: argparse.Namespace, mode: str, base: Path, rec: dict[str, Any]) -> None:
    """One mode, recorded into `rec` as it goes (so an interrupted mode still reports): a fresh
    pinned server, the pinned trainer attached to it, both stopped at the end whatever happens."""
    servers = base / f"{mode}-servers"
    node = servers / "node-0"
    servers.mkdir(parents=True)
    common = DISAGGREGATED + args.set
    trainer_overrides = common + MODES[mode] + [f"trainer.max_steps={args.steps}", f"trainer.seed={args.seed}",
                                                f"logging.output_dir={base}", f"logging.run_name={mode}"]
    cli = [sys.executable, "-m", "megatron_rl.cli"]
    rec.update({"run_dir": str(base / mode), "servers_dir": str(servers), "overrides": trainer_overrides,
                "server_log": str(base / f"{mode}.server.log"), "trainer_log": str(base / f"{mode}.trainer.log"),
                "exit_code": None, "server_left_running": None, "error": None})
    started = time.perf_counter()
    server = launch(cli + ["rollout-server", str(args.recipe), *common, "--run-dir", str(node)],
                    args.server_cpus, Path(rec["server_log"]), {})
    trainer: subprocess.Popen | None = None
    follower = MetricsFollower(base / mode / "metrics.jsonl")
    try:
        wait_server(server, node, args.timeout_s)
        rec["server_start_s"] = time.perf_counter() - started
        print(f"[async_bench] {mode}: server up after {rec['server_start_s']:.0f}s; training", file=sys.stderr)
        t0 = time.perf_counter()
        proc = trainer = launch(cli + ["train", str(args.recipe), *trainer_overrides], args.trainer_cpus,
                                Path(rec["trainer_log"]), {SERVERS_ENV: str(servers)})

        def first_row() -> None:
            rec["startup_s"] = time.perf_counter() - t0
            rec["affinity"] = {"server": {"asked": format_cpu_list(args.server_cpus), **tree_affinity(server.pid)},
                               "trainer": {"asked": format_cpu_list(args.trainer_cpus), **tree_affinity(proc.pid)}}
        follow_trainer(proc, follower, args.timeout_s, first_row)
        rec["exit_code"] = proc.returncode
        log = Path(rec["trainer_log"]).read_text(errors="replace")
        rec["attached_external_server"] = "using 1 external server(s)" in log      # train/fleet.py's line
        rec["health_stop"] = health_stop(log)
        if proc.returncode != 0 and not rec["health_stop"]:
            rec["error"] = f"trainer exited with code {proc.returncode}; see {rec['trainer_log']}"
    except Exception as exc:            # recorded; the next mode still runs
        rec["error"] = f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        rec["error"] = "interrupted"
        raise
    finally:
        if trainer is not None and trainer.poll() is None:
            end_group(trainer.pid)
            trainer.wait()
        rec["server_left_running"] = stop_server(server, node)
        rec["wall_s"] = time.perf_counter() - started
        follower.poll()
        rec.update(mode_stats(follower.rows, follower.arrivals))


# ------------------------------------------------------------------------------------- driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80, help="trainer.max_steps of each mode")
    ap.add_argument("--seed", type=int, default=1234, help="trainer.seed of both modes (1234: the trainer's default)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "async_bench")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "tiny" / "grpo.yaml")
    ap.add_argument("--modes", default="sync,async", help="comma-separated, of: " + ", ".join(MODES))
    ap.add_argument("--server-cpus", type=parse_cpu_list, default=parse_cpu_list("0"))
    ap.add_argument("--trainer-cpus", type=parse_cpu_list, default=parse_cpu_list("1"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra recipe override for the server and the trainer of both modes (repeatable)")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per server start and per trainer run")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        ap.error(f"--modes: choose from {', '.join(MODES)}")
    args.out, args.recipe = args.out.resolve(), args.recipe.resolve()
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    from bench._report import emit

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)       # so every `finally` stops what it started
    started = time.perf_counter()
    base = args.out / time.strftime("%Y%m%d-%H%M%S")
    base.mkdir(parents=True)
    loadavg_start = os.getloadavg()
    records: dict[str, dict[str, Any]] = {}
    interrupted = False
    try:
        for mode in args.modes:
            print(f"[async_bench] {mode}: starting ({args.steps} steps) in {base}", file=sys.stderr)
            records[mode] = {}
            run_mode(args, mode, base, records[mode])
    except KeyboardInterrupt:
        interrupted = True
    out = summarize(records, args.steps)
    curves = {m: r.pop("reward_curve", []) for m, r in records.items()}
    curves = {m: c for m, c in curves.items() if c}
    rates = ", ".join(f"{m} {r['steps_per_s']:.3g} steps/s" for m, r in records.items() if r.get("steps_per_s"))
    speedup = f" (speedup {out['speedup']:.2f})" if out["speedup"] else ""
    title = f"{args.recipe.parent.name}/{args.recipe.name}, {args.steps} steps: {rates}{speedup}"
    out["png"] = str(plot(curves, args.out / "async_bench.png", title)) if curves else None
    out["run_dirs"] = {m: r["run_dir"] for m, r in records.items()}
    out["throughput_measure"] = THROUGHPUT_MEASURE
    out["affinity"] = {m: r.get("affinity") for m, r in records.items()}
    out.update({"modes": records, "recipe": str(args.recipe), "seed": args.seed, "interrupted": interrupted,
                "loadavg_start": loadavg_start})
    emit(out, started, args.json_out)
    if interrupted:
        return 130
    # A run its health stopped logged fewer steps: a result (goal_met false, the reason), not a failure.
    failed = [m for m, r in records.items()
              if r.get("error") or (r.get("steps_logged", 0) < args.steps and not r.get("health_stop"))
              or r.get("server_left_running") or r.get("attached_external_server") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
