"""What a kill, a full disk or a bad input leaves behind, and how the next run copes: torn metrics,
half-written checkpoints, /dev/shm leftovers, the rendezvous socket, one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.models import TINY_MOE  # noqa: E402
from tests.helpers.rollout import REPO, demo_assets
from tests.helpers.train import ENV


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", str(REPO / "recipes/tiny/chord.yaml"),
           f"logging.output_dir={tmp_path}", "logging.run_name=bad", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_during_a_save_is_one_error_with_path_and_size_and_loses_nothing(tmp_path: Path) -> None:
    from megatron_rl.weights.tiny import build_tiny_hf_checkpoint

    model = build_tiny_hf_checkpoint(TINY_MOE, tmp_path / "model", seed=0)
    full, out = tmp_path / "full", tmp_path / "out.json"
    full.mkdir()
    script = (f"mount -t tmpfs -o size=256k tmpfs {full} && echo kept > {full}/older.txt && "
              f"{sys.executable} {REPO}/tests/mp/full_disk_worker.py {model} {tmp_path / 'roomy'} {full} {out}")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert result["roomy_latest"] == result["roomy_saved"]
    error = result["error"]
    assert error is not None and "\n" not in error
    assert f"checkpoint {full}/step_00000002: no space left" in error and "MiB" in error, error
    assert result["full_dir_after"] == ["older.txt"]              # no .partial left, nothing older lost


@pytest.mark.parametrize("rdzv", [["--master-addr=127.0.0.1"], ["--rdzv-backend=c10d", "--rdzv-id=t"]])
def test_two_ranks_listen_on_the_rendezvous_address_only(rdzv: list[str], tmp_path: Path) -> None:
    """A single-node two-rank run through `megatron_rl.launch` (static rendezvous as the tests and
    conversion use it, c10d as the Slurm job does): the store is on 127.0.0.1:<port>, and no
    socket of the launcher or the ranks listens on a wildcard address."""
    from tests.mp.launch import cpu_env, free_port

    port = free_port()
    where = [*rdzv, f"--master-port={port}"] if "--master-addr=127.0.0.1" in rdzv \
        else [*rdzv, f"--rdzv-endpoint=127.0.0.1:{port}"]
    cmd = [sys.executable, "-m", "megatron_rl.launch", "--nproc-per-node=2", *where,
           str(REPO / "tests" / "mp" / "listen_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=cpu_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["sum"] == 2.0 for r in results)
    assert f"127.0.0.1:{port}" in results[0]["agent"]
    sockets = [a for r in results for a in r["agent"] + r["worker"]]
    assert not [a for a in sockets if a.rsplit(":", 1)[0] in ("0.0.0.0", "::")], sockets


def test_a_multi_node_launch_on_a_loopback_address_stops_with_the_reason(tmp_path: Path) -> None:
    """Listening on loopback would leave the other nodes timing out at the rendezvous."""
    from tests.mp.launch import cpu_env, free_port

    cmd = [sys.executable, "-m", "megatron_rl.launch", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=t", str(REPO / "tests" / "mp" / "listen_worker.py"),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=cpu_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    reason = "rendezvous host '127.0.0.1' is a loopback address, which the other nodes"
    assert reason in proc.stderr, proc.stderr[-2000:]


def test_input_problems_found_at_run_time_are_one_line_and_leave_no_run_dir(tmp_path: Path) -> None:
    """Each fails before the server starts (data and tokenizer are read first)."""
    import shutil

    assets = demo_assets()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    no_eos = tmp_path / "no_eos"
    shutil.copytree(assets["model"], no_eos)
    cfg = json.loads((no_eos / "tokenizer_config.json").read_text())
    cfg.pop("eos_token", None)
    (no_eos / "tokenizer_config.json").write_text(json.dumps(cfg))
    cases = {f"data.train_path={empty}": f"{empty}: no prompt records",
             f"model.tokenizer={no_eos}": "the tokenizer has no EOS token"}
    for override, message in cases.items():
        proc = _train(tmp_path, override)
        assert proc.returncode == 1, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "bad").exists()
