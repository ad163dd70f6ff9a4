"""Asynchronous rollout (`rollout.max_staleness`): what `recipe validate` accepts and refuses, the
staleness bound, and the producer's schedule — which version each step's batch is generated on,
that a sync never lands inside a batch, that a too-stale group is never trained, and that what a
checkpoint records of the steps in flight is what a resume hands out again.

The fleet here is a stand-in recording calls (pure scheduling logic: which step runs on which
version, under which lock); the real servers, trainer and checkpoints are exercised by
`tests/e2e/test_async_train.py` and `bench/faults.py --max-staleness 1`."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.cli import main
from megatron_rl.train.ahead import AheadRollouts, SyncRollouts, split_stale, staleness, staleness_metrics
from megatron_rl.train.data import DataOrder, Prompts, TrainData
from megatron_rl.types import RolloutGroup, Sample

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny" / "grpo.yaml")
ASYNC = ["rollout.max_staleness=1", "rollout.placement=disaggregated", "rollout.nodes=1"]


# ------------------------------------------------------------------ recipe validate
def test_validate_accepts_async_with_disaggregated_servers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", "validate", TINY, *ASYNC, "--no-check-paths"]) == 0
    out = capsys.readouterr()
    assert "valid (0 errors, 0 warnings)" in out.out, out.out + out.err


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["rollout.max_staleness=1"], "rollout.max_staleness", "colocated"),
    (["rollout.max_staleness=2", "rollout.placement=disaggregated", "rollout.nodes=1", "rollout.sleep_level=1"],
     "rollout.sleep_level", "sleeping server"),
])
def test_validate_refuses_async_where_servers_cannot_generate_alongside(
        capsys: pytest.CaptureFixture[str], overrides: list[str], key: str, words: str) -> None:
    assert main(["recipe", "validate", TINY, *overrides, "--no-check-paths"]) == 1
    out = capsys.readouterr()
    assert f"[async-rollout] {key}:" in out.err and words in out.err, out.err


def test_validate_refuses_a_negative_bound_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", "validate", TINY, "rollout.max_staleness=-1", "--no-check-paths"]) != 0
    out = capsys.readouterr()
    assert "rollout.max_staleness" in out.err and "-1" in out.err, out.err


def test_async_without_a_correction_runs_only_when_written_and_warned(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", "validate", TINY, *ASYNC, "algorithm.correction.mode=none", "--no-check-paths"]) == 0
    out = capsys.readouterr()
    assert "warning: [async-rollout] algorithm.correction.mode:" in out.out and "(0 errors, 1 warnings)" in out.out


@pytest.mark.parametrize(("overrides", "in_force"), [
    (ASYNC, "tis_token (auto: rollout.max_staleness 1)"),
    ([], "none (auto: on-policy)"),
    ([*ASYNC, "algorithm.correction.mode=none"], "none (written; rollout.max_staleness 1: nothing corrects"),
    ([*ASYNC, "algorithm.correction.mode=mask_token"], "mask_token\n"),
])
def test_recipe_show_prints_the_correction_in_force(capsys: pytest.CaptureFixture[str], overrides: list[str],
                                                    in_force: str) -> None:
    assert main(["recipe", "show", TINY, *overrides]) == 0
    out = capsys.readouterr().out
    assert "  correction:\n    mode: " in out          # the key itself stays as written (or 'auto')
    assert f"# in force: algorithm.correction.mode {in_force}" in out, out[-600:]


def test_the_shipped_async_recipe_trains_with_token_tis_in_force(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(REPO / "recipes" / "qwen3_235b_a22b" / "grpo_async.yaml")
    assert main(["recipe", "show", recipe]) == 0
    out = capsys.readouterr().out
    assert "# in force: algorithm.correction.mode tis_token (auto: rollout.max_staleness 1)\n" in out
    assert main(["recipe", "validate", recipe, "--no-check-paths"]) == 0
    assert "async-rollout" not in capsys.readouterr().out


# ------------------------------------------------------------------ the bound
def group(index: int, *versions: int) -> RolloutGroup:
    return RolloutGroup(index, {}, [Sample([1], [2], [-0.5], weight_version=v) for v in versions])


def test_a_group_is_as_stale_as_its_oldest_sample() -> None:
    assert staleness(group(0, 5, 4, 5), 6) == 2
    assert split_stale([group(0, 5), group(1, 4), group(2, 6), group(3, 5, 3)], 6, 1) == ([0, 2], [1, 3])
    assert split_stale([group(0, 6)], 6, 0) == ([0], [])
    m = staleness_metrics([group(0, 5, 5), group(1, 6, 6)], 6, 3)
    assert m == {"rollout/staleness_mean": 0.5, "rollout/staleness_max": 1.0, "rollout/dropped_stale": 3.0}


# ------------------------------------------------------------------ the producer's schedule
class FakeFleet:
    """Records each generation: (step, prompt indices, version, whether a sync was under way)."""

    rank0 = True

    def __init__(self, generate_s: float = 0.02) -> None:
        self.calls: list[tuple[int, list[int], int]] = []
        self.generate_s = generate_s
        self.syncing = False
        self.overlaps = 0

    def rollout_rank0(self, prompts: Prompts, indices: list[int], step: int, version: int) -> list[RolloutGroup]:
        if self.syncing:
            self.overlaps += 1
        time.sleep(self.generate_s)
        self.calls.append((step, list(indices), version))
        return [group(i, version, version) for i in indices]

    def generate(self, prompts: Prompts, indices: list[int], step: int, version: int) -> list[RolloutGroup]:
        return self.rollout_rank0(prompts, indices, step, version)

    def sleep(self) -> None:
        pass


def data(size: int = 12) -> TrainData:
    prompts = Prompts([], [[i] for i in range(size)], [{} for _ in range(size)])
    return TrainData(None, prompts, DataOrder(size, seed=3), None)


Taken = tuple[int, list[int], dict[str, float], dict[str, Any]]
"""(step, the prompts trained, the rollout metrics, the data order after the step's draw)"""


def run(source: Any, fleet: FakeFleet, steps: int, version: int = 1, first: int = 1,
        train_s: float = 0.05) -> list[Taken]:
    """The loop's use of a rollout source: take, train, sync (publish) under `servers()`."""
    got = []
    source.start(first, version)
    try:
        for step in range(first, first + steps):
            taken = source.take(step, version)
            got.append((step, [g.prompt_index for g in taken.groups], taken.metrics, taken.order))
            assert all(version - s.weight_version <= max(getattr(source, "k", 0), 0)
                       for g in taken.groups for s in g.samples), "a too-stale sample reached the trainer"
            time.sleep(train_s)
            version += 1
            with source.servers():
                fleet.syncing = True
                time.sleep(0.005)
                fleet.syncing = False
            source.published(version)
    finally:
        source.close()
    return got


def test_ahead_generates_each_batch_on_one_version_within_the_bound() -> None:
    fleet = FakeFleet()
    got = run(AheadRollouts(fleet, data(), 3, last_step=8, max_staleness=1), fleet, 8)  # type: ignore[arg-type]
    assert [c[0] for c in fleet.calls] == list(range(1, 9))
    # The batch of step s may start once the servers hold P_s − 1 = s − 1 (version 1 at step 1).
    for step, _, version in fleet.calls:
        assert max(1, step - 1) <= version <= step
    assert fleet.overlaps == 0                                  # a sync never lands inside a batch
    stale = [m["rollout/staleness_max"] for _, _, m, _ in got]
    assert max(stale) == 1 and stale[0] == 0 and all(m["rollout/dropped_stale"] == 0 for _, _, m, _ in got)
    assert all(m["time/trainer_wait_s"] >= 0 and m["time/rollout_wait_s"] >= 0 for _, _, m, _ in got)


class BusyFleet(FakeFleet):
    """A client that spends `busy_s` of CPU (decoding) on top of waiting `generate_s` for the server."""

    def __init__(self, busy_s: float) -> None:
        super().__init__()
        self.busy_s = busy_s

    def rollout_rank0(self, prompts: Prompts, indices: list[int], step: int, version: int) -> list[RolloutGroup]:
        end = time.thread_time() + self.busy_s
        while time.thread_time() < end:
            pass
        return super().rollout_rank0(prompts, indices, step, version)


@pytest.mark.parametrize("ahead", [False, True])
def test_the_client_s_cpu_time_is_measured_on_the_thread_that_spends_it(ahead: bool) -> None:
    """`time/rollout_client_cpu_s` (GPU audit 3 finding 9): the CPU the client thread burnt, not its
    wait for the server, and on the producer's thread in async mode, not the trainer's."""
    for busy_s, low, high in ((0.0, 0.0, 0.015), (0.04, 0.04, 0.2)):
        fleet = BusyFleet(busy_s)
        source = (AheadRollouts(fleet, data(), 3, last_step=3, max_staleness=1) if ahead  # type: ignore[arg-type]
                  else SyncRollouts(fleet, data(), 3))                                    # type: ignore[arg-type]
        got = run(source, fleet, 3, train_s=0.0)
        cpu = [m["time/rollout_client_cpu_s"] for _, _, m, _ in got]
        assert all(low <= c < high for c in cpu), (busy_s, cpu)


def test_ahead_draws_the_prompts_the_synchronous_loop_draws() -> None:
    sync_fleet, ahead_fleet = FakeFleet(), FakeFleet()
    sync = run(SyncRollouts(sync_fleet, data(), 5), sync_fleet, 6)  # type: ignore[arg-type]
    ahead = run(AheadRollouts(ahead_fleet, data(), 5, last_step=6, max_staleness=2), ahead_fleet, 6)  # type: ignore[arg-type]
    assert [s[1] for s in sync] == [a[1] for a in ahead]
    # Staleness 0 is the synchronous loop: every batch on the version it trains.
    assert [c[2] for c in sync_fleet.calls] == list(range(1, 7))
    assert all(m["rollout/staleness_max"] == 0 and m["rollout/dropped_stale"] == 0 for _, _, m, _ in sync)


def test_a_too_stale_group_is_dropped_regenerated_and_counted() -> None:
    fleet = FakeFleet()
    source = AheadRollouts(fleet, data(), 4, last_step=3, max_staleness=1)  # type: ignore[arg-type]
    source.start(1, 1)
    first = source.take(1, 1)
    # Step 2's batch came from version 1; pretend one of its groups came from a server that
    # was still on version 0 (e.g. a stale replica).
    with source.shared.cond:
        while not (2 in source.shared.drawn and source.shared.drawn[2].groups is not None):
            source.shared.cond.wait(1.0)
        source.shared.drawn[2].groups[1] = group(source.shared.drawn[2].groups[1].prompt_index, 0, 1)  # type: ignore[index]
    second = source.take(2, 2)
    source.published(2)
    source.close()
    assert [g.prompt_index for g in first.groups] != [g.prompt_index for g in second.groups]
    assert second.metrics["rollout/dropped_stale"] == 1
    assert all(s.weight_version >= 1 for g in second.groups for s in g.samples)
    assert second.groups[1].samples[0].weight_version == 2        # regenerated on the policy's version
    assert (2, [second.groups[1].prompt_index], 2) in fleet.calls


def test_a_checkpoint_records_the_steps_in_flight_and_a_resume_trains_them_in_order() -> None:
    fleet = FakeFleet()
    d = data()
    source = AheadRollouts(fleet, d, 4, last_step=10, max_staleness=1)  # type: ignore[arg-type]
    source.start(1, 1)
    trained = [[g.prompt_index for g in source.take(1, 1).groups]]
    source.published(2)
    with source.shared.cond:             # the producer has drawn (and may be generating) steps 2 and 3
        while 3 not in source.shared.drawn:
            source.shared.cond.wait(1.0)
    state = source.state()
    source.close()
    assert len(state["in_flight"]) >= 2 and all(len(s["indices"]) == 4 for s in state["in_flight"])
    # A resumed run (a fresh TrainData loaded from the checkpoint) first trains those steps again.
    resumed = data()
    resumed.load_state(state)
    again = FakeFleet()
    got = run(AheadRollouts(again, resumed, 4, last_step=6, max_staleness=1), again, 5, version=2, first=2)  # type: ignore[arg-type]
    plain = FakeFleet()
    uninterrupted = run(SyncRollouts(plain, data(), 4), plain, 6)  # type: ignore[arg-type]
    assert trained + [g for _, g, _, _ in got] == [g for _, g, _, _ in uninterrupted]
    assert [o for *_, o in got] == [o for *_, o in uninterrupted][1:]          # the metrics' data/*


def test_a_producer_error_reaches_the_trainer() -> None:
    class Broken(FakeFleet):
        def rollout_rank0(self, *args: Any) -> list[RolloutGroup]:
            raise RuntimeError("the servers are gone")

    source = AheadRollouts(Broken(), data(), 2, last_step=3, max_staleness=1)  # type: ignore[arg-type]
    source.start(1, 1)
    with pytest.raises(RuntimeError, match="the servers are gone"):
        source.take(1, 1)
    source.close()
    assert not any(t.name == "rollout-ahead" and t.is_alive() for t in threading.enumerate())
