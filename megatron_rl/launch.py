"""`python -m megatron_rl.launch <torchrun arguments>`: torchrun, with its rendezvous store
listening only on the rendezvous address (`megatron/rendezvous.py` says why torch's does not).

Every multi-process start of the project goes through it: the Slurm job's trainer, checkpoint
conversion and the two-process test workers. The arguments are torchrun's, unchanged.
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record

from .megatron.rendezvous import install
from .ports import free_port

PORT_TRIES = 3
"""Starts of a one-node run whose rendezvous port was taken (see `main`)."""


@record
def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    install(multi_node=max_nodes > 1)
    for attempt in range(1, PORT_TRIES + 1):
        try:
            torchrun.run(args)
            return
        except dist.DistNetworkError as e:
            # A one-node run's port is picked free, then bound by the store: another process can
            # take it between the two (seen in the test suite). No other node dials it, so any
            # free port will do; a multi-node run's port is shared with the other nodes and stays.
            if max_nodes > 1 or args.rdzv_endpoint or "Address already in use" not in str(e) or attempt == PORT_TRIES:
                raise
            taken, args.master_port = args.master_port, free_port(args.master_addr)
            print(f"[launch] rendezvous port {taken} was taken; starting again on {args.master_port}",
                  file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
