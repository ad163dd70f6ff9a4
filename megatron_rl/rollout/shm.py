"""What rollout servers and trainers leave in /dev/shm (RAM) and the temp directory, and who removes it.

- The trainer's weight-sync segments, `/dev/shm/megatron-rl-sync-<pid>-*`: a full copy of the
  weights. `sync/shm.py` removes them on close, and at exit where close was not reached.
- A vLLM server's Python shared-memory blocks (`psm_*`: the engine core's 160 MiB scheduler
  broadcast queue, each worker's 240 MiB response queue) and semaphores (`sem.mp-*`). vLLM unlinks
  them only when its processes exit cleanly; a SIGKILLed group takes vLLM's resource tracker with it.
- The server's own temp directory, `<tmp>/megatron-rl-server-<pid>-*` (its TMPDIR): vLLM's
  FileStore rendezvous file `vllm_dist_*`, which torch removes only once every worker has destroyed
  its process group (never after a SIGKILL, nor when a TP-2 worker is killed before the other), and
  the engine's ZMQ sockets.

`RolloutServer.stop` (also on each restart) removes the names that appeared after its server first
started and that no live process uses, and the server's temp directory. A server whose trainer died
is SIGKILLed by its own watchdog (`server_main.py`), which first hands the names its group maps
and its temp directory to a detached `remove_after_group`. What is still left in /dev/shm (trainer
and clean-up both killed) the next run's `remove_stale` removes: sync directories whose creating
process is gone and whose files nobody maps, and `psm_*`/`sem.mp-*` files that nobody maps. `psm_*`
is any Python SharedMemory's name: a block of another program that nobody maps for 10 s is removed
too. (Temp directories are not swept so: TMPDIR may be shared by nodes, where a pid says nothing.)

"Maps" is decided by inode as well as by path: glibc's sem_open creates a semaphore under a
temporary name, maps it, links it to `sem.mp-*` and unlinks the temporary name, so its creator's
mapping reads `/dev/shm/sem.XXXXXX (deleted)`. By path alone every live semaphore looked unused,
and another run's clean-up removed one between a vLLM engine creating it and its spawned worker
(20+ s to import on a loaded host) opening it: "Engine core initialization failed".

Standard library only: the detached clean-up (`python -m megatron_rl.rollout.shm`) and the fault
bench's driver import this module without torch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

SHM = Path("/dev/shm")
SYNC_PREFIX = "megatron-rl-sync-"
SERVER_TMP_PREFIX = "megatron-rl-server-"
SERVER_TMP_ENV = "MRL_SERVER_TMPDIR"
"""Names the server's own temp directory to its processes (it is also their TMPDIR)."""
VLLM_PREFIXES = ("psm_", "sem.mp-", "vllm_dist_")
"""`vllm_dist_*` in /dev/shm: the CPU tensor-parallel communicator's blocks (`<VLLM_DIST_IDENT>-…-cpushm_<rank>`,
`vllm/distributed/device_communicators/cpu_communicator.py:237-243`), 4 MiB a worker, which its C++
manager unlinks only at a clean exit: a TP 2 server on CPU left two per SIGKILL."""


def mapped_paths(pgid: int | None = None) -> set[str]:
    """Every file that a process we can inspect (of process group `pgid`, if given) maps or holds
    open, by path and as `inode:<dev>:<ino>` (`in_use`): a mapping keeps the inode it was made
    under, whatever the file is now called."""
    found: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or (pgid is not None and pgid_of(proc) != pgid):
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    found.add(parts[5].removesuffix(" (deleted)"))
                    major, minor = parts[3].split(":")
                    found.add(f"inode:{os.makedev(int(major, 16), int(minor, 16))}:{parts[4]}")
            for fd in (proc / "fd").iterdir():
                found.add(os.readlink(fd))
        except OSError:
            continue                       # gone meanwhile, or not ours to read
    return found


def in_use(path: Path, mapped: set[str]) -> bool:
    """`path` is mapped or held open (`mapped`: from `mapped_paths`)."""
    if str(path) in mapped:
        return True
    try:
        st = path.lstat()
    except OSError:
        return False
    return f"inode:{st.st_dev}:{st.st_ino}" in mapped


# ---------------------------------------------------------------------------- process groups
def pgid_of(proc: Path) -> int | None:
    """The process group of `/proc/<pid>` (None if it is gone)."""
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def _is_zombie(proc: Path) -> bool:
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """A SIGKILLed process keeps its mappings until the kernel has torn it down (seconds for a big
    one); its shared-memory files only count as unused after that. Zombies map nothing. Returns
    whether the group went within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            members = [p for p in Path("/proc").iterdir() if p.name.isdigit() and pgid_of(p) == pgid]
        except OSError:
            return True
        if all(_is_zombie(p) for p in members):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def group_segments(pgid: int, root: Path = SHM) -> list[str]:
    """The vLLM shared-memory files in `root` that a process of group `pgid` maps or holds open:
    a live server's own, whoever else uses them too."""
    if not root.is_dir():
        return []
    mapped = mapped_paths(pgid)
    return sorted(p.name for p in root.iterdir() if p.name.startswith(VLLM_PREFIXES) and in_use(p, mapped))


# ---------------------------------------------------------------------------- removal
def creator_alive(name: str) -> bool:
    """Whether the process named in a sync directory's or a server temp directory's name
    (`<prefix><pid>-…`) is still running: its files are then its own, not leftovers."""
    for prefix in (SYNC_PREFIX, SERVER_TMP_PREFIX):
        if name.startswith(prefix):
            pid = name[len(prefix):].split("-", 1)[0]
            return pid.isdigit() and _pid_alive(int(pid))
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours_and_old(path: Path, min_age_s: float) -> bool:
    try:
        st = path.lstat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and time.time() - st.st_mtime >= min_age_s


def stale_sync_dirs(root: Path = SHM) -> list[Path]:
    """Sync directories whose creating process is gone and whose files nobody maps."""
    mapped = mapped_paths()
    stale = []
    for d in root.glob(SYNC_PREFIX + "*"):
        pid = d.name[len(SYNC_PREFIX):].split("-", 1)[0]
        if not d.is_dir() or not pid.isdigit() or creator_alive(d.name) or not _ours_and_old(d, 0):
            continue
        if not any(in_use(f, mapped) for f in d.iterdir()):
            stale.append(d)
    return stale


def stale_vllm_segments(root: Path = SHM, min_age_s: float = 10.0, among: Iterable[str] | None = None) -> list[Path]:
    """vLLM's shared-memory files (ours, older than `min_age_s`) that no live process maps."""
    mapped = mapped_paths()
    names = among if among is not None else (p.name for p in root.iterdir())
    return [root / n for n in names if n.startswith(VLLM_PREFIXES) and not in_use(root / n, mapped)
            and _ours_and_old(root / n, min_age_s)]


def _unlink(files: Iterable[Path]) -> int:
    freed = 0
    for f in files:
        try:
            freed += f.stat().st_blocks * 512
            f.unlink()
        except OSError:
            pass
    return freed


def remove_unused(names: Iterable[str], root: Path = SHM) -> int:
    """Unlink those of `names` (vLLM's files in `root`, ours) that no live process uses now: what a
    killed server could not unlink itself. Returns the bytes of memory they held."""
    return _unlink(stale_vllm_segments(root, 0.0, among=names)) if root.is_dir() else 0


def new_server_tmp_dir() -> Path:
    """A rollout server's own temp directory (its TMPDIR), named by the pid of the process starting it."""
    return Path(tempfile.mkdtemp(prefix=f"{SERVER_TMP_PREFIX}{os.getpid()}-"))


def remove_server_tmp_dir(d: Path | str | None) -> None:
    """Remove a server's temp directory; any other directory (a TMPDIR the user set) is left alone."""
    if d and Path(d).name.startswith(SERVER_TMP_PREFIX):
        shutil.rmtree(d, ignore_errors=True)


def remove_after_group(pgid: int, names: Iterable[str], tmp_dir: str | None = None, root: Path = SHM,
                       timeout_s: float = 60.0) -> int:
    """Once group `pgid` is gone (or after `timeout_s`), remove `names` from `root` where nobody uses
    them, and the group's temp directory: the clean-up of a server that nobody will stop."""
    wait_group_gone(pgid, timeout_s)
    freed = remove_unused(names, root)
    remove_server_tmp_dir(tmp_dir)
    return freed


_handed: list[subprocess.Popen[bytes]] = []
"""The clean-ups started here, kept (and reaped once done) so that none is garbage-collected running."""


def hand_over(pgid: int, names: Iterable[str], tmp_dir: Path | str | None) -> None:
    """Start the detached clean-up (`remove_after_group`) of group `pgid`: whoever is about to kill
    a server (its own watchdog, or `RolloutServer.stop`) starts it first, so that the server's
    files go once its group is gone even if the killer dies meanwhile (a trainer SIGKILLed while it
    restarts its server). Best effort: a failure to start it must not stop the kill."""
    cmd = [sys.executable, "-m", "megatron_rl.rollout.shm", "--after-group", str(pgid),
           *(["--tmp-dir", str(tmp_dir)] if tmp_dir else []), *names]
    _handed[:] = [p for p in _handed if p.poll() is None]
    try:
        _handed.append(subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        cwd=Path(__file__).resolve().parents[2]))
    except OSError:
        pass


def remove_stale(min_age_s: float = 10.0, root: Path = SHM) -> int:
    """Remove the leftovers of dead runs; returns the bytes of memory they held."""
    if not root.is_dir():
        return 0
    freed = 0
    for d in stale_sync_dirs(root):
        freed += sum(f.stat().st_blocks * 512 for f in d.iterdir() if f.is_file())
        shutil.rmtree(d, ignore_errors=True)
    return freed + _unlink(stale_vllm_segments(root, min_age_s))


def remove_stale_and_say(who: str = "") -> None:
    """`remove_stale`, printing what it freed (`who` names the node in multi-node runs)."""
    freed = remove_stale()
    if freed:
        print(f"[rollout] {who}removed {freed / 2**20:.0f} MiB of /dev/shm left by dead runs", flush=True)


def main() -> None:
    """`python -m megatron_rl.rollout.shm --after-group PGID [--tmp-dir D] NAME...`: started
    detached (its own session) by a server about to SIGKILL its own group (`server_main.py`)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--after-group", type=int, required=True)
    ap.add_argument("--tmp-dir")
    ap.add_argument("names", nargs="*")
    args = ap.parse_args()
    remove_after_group(args.after_group, args.names, args.tmp_dir)


if __name__ == "__main__":
    main()
