"""Shared-memory leftovers of dead runs in /dev/shm.

A killed trainer leaves its weight-sync segments (`megatron-rl-sync-<pid>-*`: a full copy of the
weights), and a killed vLLM server — or one whose group is SIGKILLed with its resource tracker —
leaves Python shared-memory blocks (`psm_*`) and semaphores (`sem.mp-*`). Nothing else removes
them: they hold memory until the machine reboots. A file is stale when no live process maps it
and, for sync segments, the process named in the directory is gone. `psm_*` is any Python
SharedMemory's name: a block of another program that nobody maps for 10 s is removed too.

"Maps" is decided by inode as well as by path: glibc's sem_open creates a semaphore under a
temporary name, maps it, links it to `sem.mp-*` and unlinks the temporary name, so its creator's
mapping reads `/dev/shm/sem.XXXXXX (deleted)`. By path alone every live semaphore looked unused,
and another run's clean-up removed one between a vLLM engine creating it and its spawned worker
(20+ s to import on a loaded host) opening it: "Engine core initialization failed".
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

SHM = Path("/dev/shm")
SYNC_PREFIX = "megatron-rl-sync-"
VLLM_PREFIXES = ("psm_", "sem.mp-")


def mapped_paths() -> set[str]:
    """Every file that a process we can inspect maps or holds open, by path and as `inode:<dev>:<ino>`
    (`in_use`): a mapping keeps the inode it was made under, whatever the file is now called."""
    found: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
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
        if not d.is_dir() or not pid.isdigit() or _pid_alive(int(pid)) or not _ours_and_old(d, 0):
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


def remove_stale(min_age_s: float = 10.0, root: Path = SHM) -> int:
    """Remove the leftovers of dead runs; returns the bytes of memory they held."""
    if not root.is_dir():
        return 0
    freed = 0
    for d in stale_sync_dirs(root):
        freed += sum(f.stat().st_blocks * 512 for f in d.iterdir() if f.is_file())
        shutil.rmtree(d, ignore_errors=True)
    for f in stale_vllm_segments(root, min_age_s):
        try:
            freed += f.stat().st_blocks * 512
            f.unlink()
        except OSError:
            pass
    return freed


def remove_stale_and_say(who: str = "") -> None:
    """`remove_stale`, printing what it freed (`who` names the node in multi-node runs)."""
    freed = remove_stale()
    if freed:
        print(f"[rollout] {who}removed {freed / 2**20:.0f} MiB of /dev/shm left by dead runs", flush=True)
