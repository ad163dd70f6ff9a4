"""`python -m megatron_rl.slurm.stop_relay STOP_FILE -- CMD ...`: run CMD; when STOP_FILE appears,
send SIGUSR1 to CMD's process alone.

Why not let Slurm deliver the signal: a signal sent to a job step (srun forwarding, `scancel
--signal`) reaches every process of the step, and torchrun forwards signals to each worker's whole
process group. Both hit the trainer's helpers too (the checkpoint writer's multiprocessing manager,
the colocated vLLM server), which die of SIGUSR1 while the trainer is saving. The batch script
writes the stop file instead; torchrun starts one relay per rank and each relay signals exactly its
trainer, which checkpoints at the end of its step and exits 0.

Signals the relay itself receives (SIGTERM from scancel, SIGINT, SIGUSR1) go to the trainer process
only, for the same reason. The relay exits with the trainer's status (128 + N for a signal N).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

POLL_S = 1.0
"""How often the stop file is looked for; small against slurm.signal_before_s (minutes)."""


def relay(stop_file: Path, command: Sequence[str], poll_s: float = POLL_S) -> int:
    child = subprocess.Popen(list(command))

    def forward(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    sent = False
    while True:
        try:
            code = child.wait(timeout=poll_s)
            break
        except subprocess.TimeoutExpired:
            pass
        if not sent and stop_file.exists():
            child.send_signal(signal.SIGUSR1)
            sent = True
    return code if code >= 0 else 128 - code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m megatron_rl.slurm.stop_relay STOP_FILE -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    return relay(Path(args[0]), args[2:])


if __name__ == "__main__":
    sys.exit(main())
