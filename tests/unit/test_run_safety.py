"""What a kill, a full disk or a bad input leaves behind, and how the next run copes: torn metrics,
half-written checkpoints, /dev/shm leftovers, the rendezvous socket, one-line errors."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.megatron import cpu_compat

cpu_compat.apply()   # as `megatron-rl train` does: checkpoint.py imports megatron-core

from megatron_rl.megatron.checkpoint import (  # noqa: E402
    COMPLETE,
    latest_checkpoint,
    prune_checkpoints,
    remove_partial_checkpoints,
)
from megatron_rl.rollout import shm  # noqa: E402
from megatron_rl.train.metrics import MetricsLog  # noqa: E402
from megatron_rl.train.rundir import never_started  # noqa: E402
from tests.helpers.rollout import REPO  # noqa: E402
from tests.helpers.train import ENV  # noqa: E402


# ------------------------------------------------------------------------------------ metrics
def _metrics(run: Path, *lines: str) -> None:
    (run / "metrics.jsonl").write_text("".join(lines), encoding="utf-8")

def test_a_torn_last_metrics_line_is_dropped_on_resume_and_said(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _metrics(tmp_path, *(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in range(1, 6)),
             '{"step": 6, "reward/me')
    log = MetricsLog(tmp_path, 4, False, None, "r", {})
    log.log(5, {"reward/mean": 0.25})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["reward/mean"] == 0.25
    assert "dropped a torn last line" in capsys.readouterr().out
    assert not (tmp_path / "metrics.jsonl.tmp").exists()

def test_a_bad_line_before_the_end_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    _metrics(tmp_path, '{"step": 1}\n', "garbage\n", '{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        MetricsLog(tmp_path, 2, False, None, "r", {})
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3          # left as it was

# -------------------------------------------------------------------------------- checkpoints
def _ckpt(root: Path, name: str, complete: bool = True) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if complete:
        (d / COMPLETE).write_text("{}")
    return d

def test_a_partial_save_holding_its_marker_is_never_the_latest_and_goes_on_resume(tmp_path: Path) -> None:
    _ckpt(tmp_path, "step_00000004")
    _ckpt(tmp_path, "step_00000006.partial")            # died between the marker and the rename
    _ckpt(tmp_path, "step_00000008.partial", complete=False)
    assert latest_checkpoint(tmp_path).name == "step_00000004"
    prune_checkpoints(tmp_path, 1)
    assert remove_partial_checkpoints(tmp_path) == [tmp_path / "step_00000006.partial",
                                                   tmp_path / "step_00000008.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]

# ------------------------------------------------------------------------------------ /dev/shm
def test_leftovers_of_dead_processes_go_and_live_ones_stay(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f"{shm.SYNC_PREFIX}{dead}-abc"
    live = tmp_path / f"{shm.SYNC_PREFIX}{os.getpid()}-def"
    for d in (stale, live):
        d.mkdir()
        (d / "segment-00000.bin").write_bytes(b"x" * 4096)
    old = time.time() - 3600
    unmapped, mapped = tmp_path / "psm_dead0001", tmp_path / "psm_live0001"
    for f in (unmapped, mapped, tmp_path / "sem.mp-young"):
        f.write_bytes(b"y" * 4096)
    for f in (unmapped, mapped):
        os.utime(f, (old, old))
    with open(mapped, "r+b") as handle, mmap.mmap(handle.fileno(), 4096):
        freed = shm.remove_stale(min_age_s=60.0, root=tmp_path)
    assert not stale.exists() and not unmapped.exists()
    assert live.exists() and mapped.exists() and (tmp_path / "sem.mp-young").exists()   # in use, or too new
    assert freed >= 2 * 4096

def test_a_live_semaphore_is_in_use_though_its_creator_maps_it_under_another_name() -> None:
    """glibc's sem_open maps a temporary file and renames it: only the inode ties the mapping to
    `sem.mp-*`. A clean-up that looked at paths removed live vLLM semaphores (engine start failed)."""
    import multiprocessing

    lock = multiprocessing.get_context("spawn").Lock()        # what vLLM's engine hands its workers
    live = shm.SHM / ("sem." + lock._semlock.name.lstrip("/"))  # type: ignore[attr-defined]
    assert live.exists()
    assert str(live) not in {p for p in shm.mapped_paths() if not p.startswith("inode:")}   # the old check missed it
    unused = shm.SHM / f"sem.mp-test{os.getpid()}"
    unused.write_bytes(b"z" * 32)
    try:
        stale = shm.stale_vllm_segments(min_age_s=0.0, among=[live.name, unused.name])
        assert stale == [unused]
        assert live.exists()
    finally:
        unused.unlink(missing_ok=True)
    del lock

# ------------------------------------------------------------------------------ rendezvous
def test_a_world_of_one_listens_on_loopback_only() -> None:
    code = """
import os, psutil, torch, torch.distributed as dist
from megatron_rl.train.run import init_process_group
init_process_group()
t = torch.ones(3); dist.all_reduce(t); dist.barrier()
listening = [c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
print([f"{a.ip}:{a.port}" for a in listening])
assert all(a.ip in ("127.0.0.1", "::1") for a in listening), listening
assert float(t[0]) == 1.0
"""
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]

def test_torch_listens_everywhere_and_the_bound_store_on_its_address_only() -> None:
    """torch's TCPStore server ignores its host for binding (why `megatron_rl.launch` exists:
    should torch ever bind the host, this fails and the launcher can go)."""
    from datetime import timedelta

    import psutil
    import torch.distributed as dist

    from megatron_rl.megatron import rendezvous

    def listening(port: int) -> set[str]:
        """The addresses this process listens on at `port` (a store deleted just before may still
        be closing its socket, so look at one store's port only)."""
        return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port}

    plain = rendezvous.TCPSTORE("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    assert listening(plain.port) & {"0.0.0.0", "::"}
    del plain
    for libuv in (True, False):
        store = rendezvous.bound_tcp_store("127.0.0.1", 0, 1, True, timedelta(seconds=30), use_libuv=libuv)
        client = dist.TCPStore("127.0.0.1", store.port, 1, False, timedelta(seconds=30))
        store.set("k", "v")
        assert client.get("k") == b"v" and listening(store.port) == {"127.0.0.1"}
        del client, store
    with pytest.raises(rendezvous.RendezvousAddressError, match="other nodes of a multi-node run cannot reach"):
        rendezvous.listen_on("localhost", 0, multi_node=True)

# ---------------------------------------------------------------------------------- the CLI
def test_overrides_after_resume_parse() -> None:
    from megatron_rl.cli import build_parser

    parser = build_parser()
    args, extra = parser.parse_known_args(["train", "r.yaml", "--resume", "trainer.lr=1", "rollout.n=2"])
    assert extra == ["trainer.lr=1", "rollout.n=2"]
    with pytest.raises(SystemExit):
        from megatron_rl.cli import main
        main(["train", "r.yaml", "--resume", "--no-such-flag"])

def test_a_run_dir_without_a_step_does_not_block_a_rerun(tmp_path: Path) -> None:
    (tmp_path / "recipe.resolved.yaml").write_text("x: 1\n")
    (tmp_path / "rollout").mkdir()
    assert never_started(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert not never_started(tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "notes.txt").write_text("someone else's")           # not a run's own file: never taken
    assert not never_started(tmp_path)

@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_when_writing_the_resolved_recipe_names_path_and_bytes_and_leaves_no_tmp(tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    code = f"""
from megatron_rl.config import load_recipe
from megatron_rl.config.loader import write_resolved
try:
    write_resolved(load_recipe({str(REPO / 'recipes/tiny/grpo.yaml')!r}), {str(full)!r})
except OSError as exc:
    print("ERROR", exc)
"""
    (tmp_path / "write.py").write_text(code)
    script = (f"mount -t tmpfs -o size=4k tmpfs {full} && head -c 4096 /dev/zero > {full}/filler; "
              f"{sys.executable} {tmp_path / 'write.py'}; ls {full}")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], env=ENV, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert f"ERROR [Errno 28] cannot write {full}/recipe.resolved.yaml (" in out, out + proc.stderr
    assert " bytes): " in out, out + proc.stderr
    assert out.strip().splitlines()[-1] == "filler"                   # no recipe.resolved.yaml.tmp left
