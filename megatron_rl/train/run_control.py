"""Stopping a run: the signal that asked a rank to stop, and the step at which all ranks agree."""

from __future__ import annotations

import signal
from typing import Any

import torch
import torch.distributed as dist


class Stop(Exception):
    """The run must stop (reason in the message)."""


class StopSignals:
    """Records SIGTERM, SIGUSR1 (Slurm's warning before the time limit) and SIGINT instead of
    dying: the loop stops at the next step boundary and checkpoints first."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def install(self) -> StopSignals:
        def handler(signum: int, frame: Any) -> None:
            self.reason = signal.Signals(signum).name

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, handler)
        return self


def agree_on_stop(reason: str | None) -> str | None:
    """Why the run stops after this step, or None (collective). Signals reach ranks at different
    moments; all ranks must stop (and save) at the same step, or the collective checkpoint hangs:
    MAX-reduce the flag once per step."""
    flag = torch.tensor([1.0 if reason else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not reason:
        return "stop requested on another rank"
    return reason
