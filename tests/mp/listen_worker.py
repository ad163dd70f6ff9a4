"""torchrun worker: which TCP sockets a two-rank run listens on — this rank's and its launcher's
(torchrun's agent, the parent process, which hosts the rendezvous store).

`python -m megatron_rl.launch --nproc-per-node 2 ... tests/mp/listen_worker.py OUT_DIR`
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from megatron_rl.train.run import init_process_group


def listening(pid: int) -> list[str]:
    return sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process(pid).net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN)


def main() -> None:
    out = Path(sys.argv[1])
    init_process_group()
    t = torch.ones(2)
    dist.all_reduce(t)                                   # the store and gloo's pairs are all up
    result = {"sum": float(t[0]), "worker": listening(os.getpid()), "agent": listening(os.getppid())}
    dist.barrier()                                       # both ranks looked while everything lives
    (out / f"{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
