"""Asynchronous rollout end to end (`rollout.max_staleness: 1`, disaggregated: the trainer attaches
to the session's shared server): every trained batch is within one version of the policy, the
waits and staleness are logged, a checkpoint records the steps in flight, and `--resume` trains
those steps again, so no step is lost or logged twice and the prompts come in the order of an
uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.train import SMALL, metrics, run_train

ASYNC = ["rollout.max_staleness=1", "rollout.placement=disaggregated", "rollout.nodes=1",
         "trainer.max_steps=4", "checkpoint.save_interval=2", "checkpoint.keep_last=3"]
"""No `algorithm.correction.mode`: its default ('auto') is token-level TIS with staleness."""
PROMPTS_PER_STEP = 4            # SMALL: a global batch of 16 samples, 4 per prompt


def test_async_run_stays_within_the_bound_and_resumes_its_steps_in_flight(tmp_path: Path,
                                                                           demo_servers_dir: Path) -> None:
    assert "trainer.global_batch_size=16" in SMALL and "rollout.n=4" in SMALL
    run = run_train("grpo.yaml", tmp_path, "async", *ASYNC, servers=demo_servers_dir)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Step 1's batch is generated on the starting weights; from step 2 on, each was generated while
    # the step before trained, one version behind the policy it updates, and none was dropped.
    assert rows[0]["rollout/staleness_max"] == 0
    assert all(r["rollout/staleness_max"] <= 1 and r["rollout/dropped_stale"] == 0 for r in rows)
    assert any(r["rollout/staleness_max"] == 1 for r in rows[1:])
    assert [r["rollout/generated_version"] for r in rows] == [1, 1, 2, 3]
    assert [r["weight_version"] for r in rows] == [2, 3, 4, 5]           # as the synchronous loop's
    assert all(r["time/trainer_wait_s"] >= 0 and r["time/rollout_wait_s"] >= 0 for r in rows)
    assert all(r["sync/verify_max_abs_diff"] <= 1e-4 for r in rows)      # every sync still verified
    # The default correction is in force: each update weighted the tokens by π_old/π_rollout.
    assert all("train/token/is_weight_mean" in r and "train/token/tis_truncated_count" in r for r in rows)

    # Each step's prompts come next in the data order, as in a synchronous run: the producer's
    # draws for later steps do not show (the demo has 2,000 prompts: one epoch here).
    assert [(r["data/epoch"], r["data/position"]) for r in rows] == [(0, PROMPTS_PER_STEP * r["step"]) for r in rows]

    # Step 2's checkpoint holds what was drawn for later steps; a resume from it trains those again.
    meta = json.loads((run / "checkpoints" / "step_00000002" / "complete.json").read_text())
    in_flight = meta["extra"]["in_flight"]
    assert 1 <= len(in_flight) <= 2 and all(len(s["indices"]) == PROMPTS_PER_STEP for s in in_flight)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    resumed = metrics(run_train("grpo.yaml", tmp_path, "async", *ASYNC, "--resume", servers=demo_servers_dir))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]                  # none lost, none twice
    for a, b in zip(rows, resumed):
        assert (b["data/epoch"], b["data/position"]) == (a["data/epoch"], a["data/position"])
    assert resumed[2]["rollout/staleness_max"] == 0                     # regenerated on the resumed weights
    assert [r["weight_version"] for r in resumed] == [2, 3, 4, 5]

