"""CPU weight transport: safetensors buckets in a shared-memory directory + authenticated RPCs.

The trainer writes each bucket to /dev/shm (memory, not disk), the server's worker extension
records its path; `finish` makes the server reload all buckets at once and repack CPU MoE
weights, then the files are removed. The sequence around it is pause (waiting for in-flight
requests) → update → finish → reset prefix cache → resume.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file


class ControlEndpoint(Protocol):
    def post(self, path: str, body: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
             timeout: float = 600.0) -> Any: ...

    def rpc(self, method: str, *args: str, timeout: float = 600.0) -> list[Any]: ...


def _shm_root() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


class FileTransport:
    """One weight update at a time: begin → send_bucket* → finish (or abort).

    The buckets of the latest finished update stay in shared memory until the next one finishes,
    so a restarted server can be brought to the current weights (`resend_latest`) without the
    trainer ranks gathering again.
    """

    def __init__(self, server: ControlEndpoint, root: Path | None = None) -> None:
        self.server = server
        # /dev/shm for a server on this host; a directory both sides see (the shared run dir)
        # for servers on other nodes.
        self.root = root
        self.dir: Path | None = None
        self.latest: tuple[int, Path, list[str]] | None = None
        self.version = 0
        self.buckets = 0
        self.bytes_sent = 0

    def begin(self, version: int) -> None:
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"megatron-rl-sync-v{version}-", dir=self.root or _shm_root()))
        self.version = version
        self.buckets = self.bytes_sent = 0
        self.server.post("/pause", params={"mode": "wait"})
        self.server.rpc("mrl_begin_update", str(version))

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        assert self.dir is not None, "begin() first"
        path = self.dir / f"bucket-{self.buckets:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        path.chmod(0o600)
        self.server.rpc("mrl_add_bucket", str(path))
        self.buckets += 1
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors.values())

    def finish(self, names: list[str]) -> dict[str, Any]:
        assert self.dir is not None
        try:
            (result,) = self.server.rpc("mrl_finish_update", json.dumps(sorted(names)))
            self.server.post("/reset_prefix_cache")
        except BaseException:
            self.abort()
            raise
        self.server.post("/resume")
        if self.latest is not None:
            shutil.rmtree(self.latest[1], ignore_errors=True)
        self.latest, self.dir = (self.version, self.dir, sorted(names)), None
        return result

    def resend_latest(self) -> dict[str, Any] | None:
        """Load the latest finished update into a (restarted) server again."""
        if self.latest is None:
            return None
        version, directory, names = self.latest
        self.server.rpc("mrl_begin_update", str(version))
        for path in sorted(directory.glob("bucket-*.safetensors")):
            self.server.rpc("mrl_add_bucket", str(path))
        (result,) = self.server.rpc("mrl_finish_update", json.dumps(names))
        self.server.post("/reset_prefix_cache")
        return result

    def abort(self) -> None:
        try:
            self.server.post("/resume")
        finally:
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None

    def close(self) -> None:
        if self.latest is not None:
            shutil.rmtree(self.latest[1], ignore_errors=True)
            self.latest = None
