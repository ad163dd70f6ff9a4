"""`python -m megatron_rl.launch <torchrun arguments>`: torchrun, with its rendezvous store
listening only on the rendezvous address (`megatron/rendezvous.py` says why torch's does not).

Every multi-process start of the project goes through it: the Slurm job's trainer, checkpoint
conversion and the two-process test workers. The arguments are torchrun's, unchanged.
"""

from __future__ import annotations

import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record

from .megatron.rendezvous import install


@record
def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    install(multi_node=max_nodes > 1)
    torchrun.run(args)


if __name__ == "__main__":
    main()
