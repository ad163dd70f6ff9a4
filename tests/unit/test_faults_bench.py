"""bench/faults.py's bookkeeping (pure logic; the run itself takes ~25 minutes of real servers):
its plan reaches every phase, and a kill that was never reached or never noticed fails the run."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import faults  # noqa: E402


def test_the_plan_covers_every_phase_and_never_kills_a_dead_server() -> None:
    for seed in range(5):
        plan = faults.schedule(20, seed)
        assert sorted(plan) == list(range(1, 21))
        assert {p for phases in plan.values() for p in phases} == set(faults.PHASES)
        for step, phases in plan.items():
            if "init" in phases:                 # reached only while a server killed before is brought back
                assert phases == ["train", "init"]
            if phases == ["checkpoint"]:
                assert step % faults.SAVE_INTERVAL == 0 and step < 20 and plan[step + 1] != ["reseed"]


def test_a_planned_kill_never_reached_is_reported() -> None:
    plan = {1: ["reset"], 2: ["train", "init"], 3: ["pause"]}
    hit = [{"step": 1, "phase": "reset"}, {"step": 2, "phase": "train"}]
    assert faults.never_reached(plan, hit, last_step=2) == ["step 2: init"]      # step 3 never ran
    assert faults.never_reached(plan, hit + [{"step": 2, "phase": "init"}], last_step=2) == []
    # A partial fault is reached only by its own kind.
    partial = {1: ["update@api"]}
    assert faults.never_reached(partial, [{"step": 1, "phase": "update", "kind": "stop"}], 1) == ["step 1: update@api"]
    assert faults.never_reached(partial, [{"step": 1, "phase": "update", "kind": "api"}], 1) == []


def test_a_kill_no_restart_followed_is_reported() -> None:
    def kill(step: int, restarts: int, pid: int = 10) -> dict:
        return {"step": step, "phase": "x", "restarts": restarts, "trainer_pid": pid}

    finished = [{"trainer_pid": 10, "restarts": 3}]
    assert faults.not_met([kill(1, 0), kill(2, 1), kill(3, 2)], finished, None) == []
    assert faults.not_met([kill(1, 0), kill(2, 0), kill(3, 2)], finished, None) == ["step 1: x (trainer 10)"]
    assert faults.not_met([kill(1, 0), kill(2, 1), kill(3, 3)], finished, None) == ["step 3: x (trainer 10)"]
    # The SIGKILLed trainer's last kill has nothing after it; its step is redone by the resumed run.
    assert faults.not_met([kill(1, 0, pid=7), kill(2, 1, pid=7)], [], killed_pid=7) == []
    assert faults.not_met([kill(1, 0, pid=7), kill(2, 0, pid=7)], [], killed_pid=7) == ["step 1: x (trainer 7)"]


def test_leftovers_of_a_live_process_are_not_the_runs(tmp_path: Path) -> None:
    # On a shared host other trainers and servers run meanwhile: a sync or temp directory named by
    # a live process is theirs; one whose creator has exited is a leftover.
    import os
    import subprocess

    from megatron_rl.rollout import shm

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    live = str(os.getpid())
    names = {f"{shm.SERVER_TMP_PREFIX}{live}-a", f"{shm.SERVER_TMP_PREFIX}{dead}-b", f"vllm_dist_{dead}", "other"}
    assert faults.tmp_left(names) == sorted([f"{shm.SERVER_TMP_PREFIX}{dead}-b", f"vllm_dist_{dead}"])
    assert shm.creator_alive(f"{shm.SYNC_PREFIX}{live}-x") and not shm.creator_alive(f"{shm.SYNC_PREFIX}{dead}-x")
    assert not shm.creator_alive("psm_1234")


def test_every_partial_fault_is_planned_once_at_a_request_in_flight() -> None:
    kinds = faults.KINDS
    steps = faults.steps_needed(kinds)
    plan = faults.schedule(steps, 3, kinds)
    planned = [item for items in plan.values() for item in items]
    partial = [i for i in planned if "@" in i]
    assert sorted(partial) == sorted(f"{p}@{k}" for k in kinds if k != "group" for p in faults.PARTIAL_PHASES)
    assert {faults.phase_and_kind(i)[0] for i in planned if "@" not in i} == set(faults.PHASES)
    assert faults.phase_and_kind("update@stop") == ("update", "stop")
    assert faults.phase_and_kind("train") == ("train", "group")
    assert not any(items == ["checkpoint"] for items in faults.schedule(30, 0, ("api",)).values())


def test_recovery_seconds_are_per_fault_and_the_worst_is_named() -> None:
    inj = [{"step": 1, "phase": "update", "kind": "api", "t": 100.0, "trainer_pid": 1},
           {"step": 2, "phase": "generate", "kind": "stop", "t": 200.0, "trainer_pid": 1},
           {"step": 3, "phase": "resume", "kind": "engine", "t": 300.0, "trainer_pid": 1}]
    rec = [{"t": 112.5, "failed_t": 101.0, "restart_s": 9.0, "trainer_pid": 1},
           {"t": 271.0, "failed_t": 211.5, "restart_s": 50.0, "trainer_pid": 1},
           {"t": 120.0, "trainer_pid": 2}]
    out = faults.recovery_report(inj, rec)
    assert out["recovery_s_worst"] == {"step": 2, "phase": "generate", "kind": "stop", "s": 71.0,
                                       "failed_after_s": 11.5, "restart_s": 50.0}
    assert out["recovery_s_worst_by_kind"] == {"api": 12.5, "stop": 71.0}
    assert out["failed_after_s_worst"] == 11.5 and out["recoveries"][0]["failed_after_s"] == 1.0
    assert [x["step"] for x in out["recovery_over_60s"]] == [2] and [x["step"] for x in out["never_recovered"]] == [3]


def test_a_run_too_short_for_the_trainer_kill_finishes_with_its_first_trainer() -> None:
    # --steps below the trainer-kill step: no resume, the first trainer's exit code is the run's
    # (it was counted as unfinished, so every fault of such a run read "not survived").
    assert faults.run_finished(0, None, killed=False)
    assert not faults.run_finished(1, None, killed=False)
    assert faults.run_finished(-9, 0, killed=True)
    assert not faults.run_finished(-9, 1, killed=True)
    assert not faults.run_finished(0, None, killed=True)


def test_delta_runs_in_both_modes_and_their_sync_rounds_are_counted() -> None:
    args = faults.parse(["--delta"])
    assert args.delta and args.max_staleness == 0
    assert "rollout.sync_delta=on" in faults.DELTA_OVERRIDES and "trainer.lr=1e-6" in faults.DELTA_OVERRIDES
    both = faults.parse(["--delta", "--max-staleness", "1"])     # the rollout nodes' copies take deltas too
    overrides = faults.child_overrides(both)
    assert "rollout.sync_delta=on" in overrides and "rollout.placement=disaggregated" in overrides
    from megatron_rl.config.check import load_checked
    assert load_checked(str(faults.REPO / "recipes/tiny/grpo.yaml"), overrides, check_paths=False) is not None
    rows = [{"sync/dense": 1, "sync/changed_frac": 1.0, "sync/bytes": 900},
            *({"sync/dense": 0, "sync/changed_frac": f, "sync/bytes": b}
              for f, b in [(0.01, 30), (0.03, 10), (0.02, 20)]),
            {"step": 5}]                     # a step without a sync's metrics
    assert faults.sync_rounds(rows) == {"delta": 3, "dense": 1, "delta_changed_frac_median": 0.02,
                                        "delta_bytes_median": 20}
    assert faults.sync_rounds([])["delta_changed_frac_median"] is None


def test_a_delta_run_whose_syncs_all_went_whole_does_not_pass() -> None:
    clean = {"survived": 3, "injected": 3, "steps_lost": [], "steps_duplicated": [], "never_reached": [],
             "not_met": [], "health": {"collapsed": False}, "recovery_over_60s": [], "processes_left": [],
             "ports_left": [], "left_after_10s": [], "shm_left": [], "tmp_left": []}
    rounds = {"delta": 0, "dense": 20, "delta_changed_frac_median": None, "delta_bytes_median": None}
    assert faults.passed({**clean, "delta": False, "sync_rounds": rounds})
    assert not faults.passed({**clean, "delta": True, "sync_rounds": rounds})
    assert faults.passed({**clean, "delta": True, "sync_rounds": {**rounds, "delta": 19, "dense": 1}})
