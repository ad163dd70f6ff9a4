"""Where each step's rollout groups come from: generated on the spot (`rollout.max_staleness` 0,
the synchronous loop) or ahead of the trainer (k >= 1, asynchronous rollout).

Asynchronous rollout. On rank 0 a producer thread keeps the servers generating: the batch of step
s is started as soon as the servers hold a version at most k behind the policy step s will update
(π at step s is the version the loop synced before it, P_s; the batch may start once the servers
hold P_s − k). The trainer takes step s's batch when it needs it and the other ranks receive it
by broadcast, as in the synchronous loop.

One version per batch. The servers are driven by one thread at a time (`servers`): a weight sync,
its verification and the periodic evaluation wait for the batch in flight to finish, and the next
batch starts on the new weights. So every sample of a batch was generated on one weight version,
recorded in `Sample.weight_version`, and its behaviour log-probs (and, with routing replay, its
routes, re-scored before the next sync) are those of that version. The alternative — letting a
sync land mid-request and recording two versions per sample — would mix two behaviour policies in
one response, which neither the importance correction nor routing replay can describe.

Staleness is checked when the trainer takes a batch: a group whose oldest sample is more than k
versions behind the policy being updated is dropped and its prompt regenerated on the current
weights (`rollout/dropped_stale`), never trained. The version gate above keeps this from
happening in a healthy run; the check is what guarantees the bound.

Nothing lost. A checkpoint records the data order after every draw and the steps drawn but not
yet trained (`in_flight`); `--resume` regenerates those first, on the resumed weights, so a
resumed run trains the same prompts in the same steps as one that never stopped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..megatron.devices import from_rank0
from ..route_rows import hold_on_rank0
from ..types import RolloutGroup
from .data import TrainData

if TYPE_CHECKING:      # the servers' side needs megatron-core; the scheduling here does not
    from .fleet import RolloutFleet

JOIN_TIMEOUT_S = 30.0
"""How long closing waits for the batch in flight before leaving the (daemon) producer behind."""


@dataclass(frozen=True)
class StepRollout:
    """One step's groups as the trainer trains them, with what the rollout measured."""

    groups: list[RolloutGroup]
    metrics: dict[str, float]
    """`rollout/staleness_*`, `rollout/dropped_stale`, `time/trainer_wait_s`, `time/rollout_wait_s`
    (async: measured here; sync: `time/rollout_wait_s` is filled in by the loop), and
    `time/rollout_client_cpu_s`: the CPU time rank 0's thread spent in the client for this batch
    (requests, JSON, decoding), which in async mode runs beside the training step (GPU audit 3
    finding 9: the producer competes with rank 0's kernel launches for the GIL)."""
    order: dict[str, Any]
    """The prompt order right after this step's prompts were drawn (the metrics' data/*)."""


def staleness(group: RolloutGroup, policy_version: int) -> int:
    """Versions between the policy being updated and the oldest weights a sample came from."""
    return policy_version - min(s.weight_version for s in group.samples)


def split_stale(groups: Sequence[RolloutGroup], policy_version: int,
                max_staleness: int) -> tuple[list[int], list[int]]:
    """(positions of the groups within the bound, positions of those beyond it)."""
    fresh: list[int] = []
    stale: list[int] = []
    for i, g in enumerate(groups):
        (stale if staleness(g, policy_version) > max_staleness else fresh).append(i)
    return fresh, stale


def staleness_metrics(groups: Sequence[RolloutGroup], policy_version: int, dropped: int) -> dict[str, float]:
    ages = [policy_version - s.weight_version for g in groups for s in g.samples]
    return {"rollout/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "rollout/staleness_max": float(max(ages, default=0)), "rollout/dropped_stale": float(dropped)}


class SyncRollouts:
    """`rollout.max_staleness` 0: the step's prompts are generated when the trainer asks, with the
    weights the loop just synced (every rank draws the same prompts)."""

    def __init__(self, fleet: RolloutFleet, data: TrainData, prompts_per_step: int) -> None:
        self.fleet, self.data, self.prompts_per_step = fleet, data, prompts_per_step

    def start(self, first_step: int, version: int) -> None:
        pass

    def take(self, step: int, version: int) -> StepRollout:
        begin = time.perf_counter()
        drawn = self.data.draw(self.prompts_per_step)
        cpu = time.thread_time()
        groups = self.fleet.generate(self.data.prompts, drawn["indices"], step, version)
        cpu = time.thread_time() - cpu
        self.fleet.sleep()
        metrics = staleness_metrics(groups, version, 0)
        metrics["time/trainer_wait_s"] = time.perf_counter() - begin
        metrics["time/rollout_client_cpu_s"] = cpu
        return StepRollout(groups, metrics, drawn["order"])

    def servers(self) -> AbstractContextManager[None]:
        return nullcontext()

    def published(self, version: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return self.data.state()

    def close(self) -> None:
        pass


@dataclass
class _Drawn:
    step: int
    indices: list[int]
    order: dict[str, Any]
    groups: list[RolloutGroup] | None = None
    version: int = 0
    idle_s: float = 0.0
    """How long the servers had nothing to generate before this batch started."""
    cpu_s: float = 0.0
    """The producer thread's CPU time for this batch."""


@dataclass
class _Shared:
    """What the producer and the trainer share, guarded by `cond`."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    version: int = 0
    """The weight version the servers hold (the last one published)."""
    drawn: dict[int, _Drawn] = field(default_factory=dict)
    """Steps drawn and not yet taken by the trainer, generated or not."""
    error: BaseException | None = None
    closed: bool = False


class AheadRollouts:
    """`rollout.max_staleness` = k >= 1: rank 0's producer thread generates up to k steps ahead.
    `take` is collective (rank 0 broadcasts the step's groups); `servers` guards every other use
    of the servers; `published` tells the producer the servers' new version."""

    def __init__(self, fleet: RolloutFleet, data: TrainData, prompts_per_step: int, last_step: int,
                 max_staleness: int) -> None:
        self.fleet, self.data, self.prompts_per_step = fleet, data, prompts_per_step
        self.last_step, self.k = last_step, max_staleness
        self.shared = _Shared()
        self.lock = threading.Lock()
        """Held by whoever drives the servers: the producer for a batch, the trainer for a sync."""
        self.first_step = 0
        self.first_version = 0
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ trainer side
    def start(self, first_step: int, version: int) -> None:
        """Start generating from `first_step`, whose policy is `version` (the servers hold it)."""
        self.first_step, self.first_version = first_step, version
        self.shared.version = version
        if self.fleet.rank0 and first_step <= self.last_step:
            self.thread = threading.Thread(target=self._produce, name="rollout-ahead", daemon=True)
            self.thread.start()

    def take(self, step: int, version: int) -> StepRollout:
        """Step `step`'s groups, every one at most k versions behind `version` (collective; the
        routes stay on rank 0, as in `RolloutFleet.generate`)."""
        mine = self._take_rank0(step, version) if self.fleet.rank0 else None
        shared = from_rank0(None if mine is None else replace(mine, groups=hold_on_rank0(mine.groups)))
        return shared if mine is None else mine

    @contextmanager
    def servers(self) -> Iterator[None]:
        """The trainer's turn with the servers (weight sync, verification, evaluation)."""
        with self.lock:
            yield

    def published(self, version: int) -> None:
        with self.shared.cond:
            self.shared.version = version
            self.shared.cond.notify_all()

    def state(self) -> dict[str, Any]:
        """What a checkpoint records (collective; rank 0's, which drew the prompts): the data
        orders and the steps drawn but not yet trained."""
        mine = None
        if self.fleet.rank0:
            with self.shared.cond:
                drawn = [{"indices": d.indices, "order": d.order}
                         for d in sorted(self.shared.drawn.values(), key=lambda d: d.step)]
                state = self.data.state()
                mine = {**state, "in_flight": drawn + state["in_flight"]}
        return dict(from_rank0(mine))

    def close(self) -> None:
        with self.shared.cond:
            self.shared.closed = True
            self.shared.cond.notify_all()
        if self.thread is not None:
            self.thread.join(JOIN_TIMEOUT_S)

    def _take_rank0(self, step: int, version: int) -> StepRollout:
        begin = time.perf_counter()
        with self.shared.cond:
            while not (step in self.shared.drawn and self.shared.drawn[step].groups is not None):
                if self.shared.error is not None:
                    raise self.shared.error
                if self.thread is None or not self.thread.is_alive():
                    raise RuntimeError(f"the rollout producer stopped before step {step}'s batch")
                self.shared.cond.wait(timeout=1.0)
            drawn = self.shared.drawn.pop(step)
        waited = time.perf_counter() - begin
        assert drawn.groups is not None
        groups = list(drawn.groups)
        fresh, stale = split_stale(groups, version, self.k)
        if stale:
            with self.lock:          # the servers hold `version` now: regenerate there
                again = self.fleet.rollout_rank0(self.data.prompts, [groups[i].prompt_index for i in stale],
                                                 step, version)
            for i, group in zip(stale, again):
                groups[i] = group
            print(f"[rollout] step {step}: {len(stale)} group(s) more than {self.k} version(s) behind "
                  f"{version} dropped and regenerated", flush=True)
        metrics = staleness_metrics(groups, version, len(stale))
        metrics.update({"time/trainer_wait_s": waited, "time/rollout_wait_s": drawn.idle_s,
                        "time/rollout_client_cpu_s": drawn.cpu_s,
                        "rollout/generated_version": float(drawn.version)})
        return StepRollout(groups, metrics, drawn.order)

    # ------------------------------------------------------------------ producer (rank 0)
    def _produce(self) -> None:
        idle_since = time.perf_counter()
        try:
            for step in range(self.first_step, self.last_step + 1):
                drawn = self._draw(step)
                # The policy step s updates is first_version + (s − first_step); its batch may be
                # generated on any version from k below it.
                floor = self.first_version + (step - self.first_step) - self.k
                with self.shared.cond:
                    while self.shared.version < floor and not self.shared.closed:
                        self.shared.cond.wait()
                    if self.shared.closed:
                        return
                with self.lock:
                    drawn.idle_s = time.perf_counter() - idle_since
                    version = self.shared.version
                    cpu = time.thread_time()
                    groups = self.fleet.rollout_rank0(self.data.prompts, drawn.indices, step, version)
                    drawn.cpu_s = time.thread_time() - cpu
                    idle_since = time.perf_counter()
                with self.shared.cond:
                    drawn.groups, drawn.version = groups, version
                    self.shared.cond.notify_all()
        except BaseException as exc:      # the trainer re-raises it at its next take
            with self.shared.cond:
                if not self.shared.closed:
                    self.shared.error = exc
                self.shared.cond.notify_all()

    def _draw(self, step: int) -> _Drawn:
        with self.shared.cond:
            entry = self.data.draw(self.prompts_per_step)
            drawn = _Drawn(step, entry["indices"], entry["order"])
            self.shared.drawn[step] = drawn
        return drawn


Rollouts = SyncRollouts | AheadRollouts


def make_rollouts(fleet: RolloutFleet, data: TrainData, prompts_per_step: int, last_step: int,
                  max_staleness: int) -> Rollouts:
    if max_staleness == 0:
        return SyncRollouts(fleet, data, prompts_per_step)
    return AheadRollouts(fleet, data, prompts_per_step, last_step, max_staleness)
