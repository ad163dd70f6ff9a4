"""torchrun worker (4 gloo processes): R3 routes held by rank 0 reach exactly the ranks of the
data-parallel replica that computes each row (`megatron/route_delivery.py`), at four layouts.

Run as `torchrun --nproc-per-node 4 tests/mp/route_delivery_worker.py OUT_JSON`.

Every rank regenerates the same samples from one seed (its reference); only rank 0's store holds
the arrays (`hold_on_rank0`). One store goes through TP1 (DP 4), TP2 (DP 2), PP2 (DP 2) and TP2 × PP2
(DP 1), three deliveries each: the padded split, a shuffled split, and the shuffled split again.
After each, every rank reports what it holds, whether each array equals the reference bit for bit,
and the bytes it received; rank 0 writes them all.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

from megatron_rl.config.schema import ParallelismConfig  # noqa: E402
from megatron_rl.megatron.actor import init_parallel  # noqa: E402
from megatron_rl.megatron.devices import init_distributed  # noqa: E402
from megatron_rl.megatron.route_delivery import deliver  # noqa: E402
from megatron_rl.route_rows import RouteRows, hold_on_rank0  # noqa: E402
from megatron_rl.types import RolloutGroup, Sample  # noqa: E402
from tests.mp.common import finish  # noqa: E402

LAYOUTS = {
    "tp1_dp4": ParallelismConfig(),
    "tp2_dp2": ParallelismConfig(tensor_model_parallel_size=2),
    "pp2_dp2": ParallelismConfig(pipeline_model_parallel_size=2),
    "tp2_pp2_dp1": ParallelismConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
}
ROWS, SEQ_LEN, LAYERS, TOPK = 12, 20, 3, 4


def reference() -> list[np.ndarray]:
    """The same samples on every rank: lengths 0 … 25 (some cut at SEQ_LEN), 512 experts (uint16)."""
    rng = np.random.default_rng(0)
    lengths = [0, 25, *rng.integers(1, SEQ_LEN, ROWS - 2)]
    return [rng.integers(0, 512, (int(n), LAYERS, TOPK)).astype(np.uint16) for n in lengths]


def held_rows(arrays: list[np.ndarray]) -> RouteRows:
    group = RolloutGroup(0, {}, [Sample([], [], [], routed_experts=a.copy()) for a in arrays])
    sent = hold_on_rank0([group])[0]
    samples = group.samples if dist.get_rank() == 0 else sent.samples
    rows = RouteRows.of_samples([s.routed_experts for s in samples], SEQ_LEN)
    assert rows is not None and not rows.store.everywhere
    return rows


def check(rows: RouteRows, arrays: list[np.ndarray], need: list[int], before: set[int], got: int) -> dict:
    """What this rank holds after a delivery that should leave it `need` (rank 0: everything)."""
    held = sorted(rows.store.arrays)
    exact = all(np.array_equal(rows.store.arrays[i], arrays[i][:SEQ_LEN]) for i in held)
    new = [i for i in need if i not in before]
    expected_bytes = 0 if dist.get_rank() == 0 else sum(arrays[i][:SEQ_LEN].nbytes for i in new)
    return {"held": held, "need": need, "exact": exact, "bytes": got, "expected_bytes": expected_bytes}


def main() -> None:
    out = sys.argv[1]
    init_distributed()
    arrays = reference()
    rows = held_rows(arrays)
    everything = rows.samples()
    result: dict = {"everything": everything}
    for name, layout in LAYOUTS.items():
        init_parallel(layout, seed=0)
        dp, mine = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        order = np.random.default_rng(len(name)).permutation(ROWS).tolist()
        per = ROWS // dp
        splits = [[list(range(d * per, (d + 1) * per)) for d in range(dp)],
                  [order[d * per:(d + 1) * per] for d in range(dp)]]
        reports = []
        for split in splits + splits[1:]:
            before = set(rows.store.arrays)
            got = deliver(rows, split)
            need = everything if dist.get_rank() == 0 else rows.samples(split[mine])
            mine_report = check(rows, arrays, need, before, got)
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine_report)
            reports.append(every)
        result[name] = reports
    finish(result, out)


if __name__ == "__main__":
    main()
