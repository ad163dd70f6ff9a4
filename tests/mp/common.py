"""What the torchrun workers in tests/mp/ share: their epilogue and free loopback ports."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the tests' rendezvous and stores bind loopback only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def finish(result: Any, out: str | Path) -> None:
    """The workers' epilogue: rank 0 writes `result` as JSON to `out`; every rank waits for it, then
    leaves the process group (so the test reads a complete file once torchrun returns)."""
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
