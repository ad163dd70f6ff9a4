"""torchrun worker: delta syncs compared by the owners of the weights (`sync/owners.py`) from a real
Megatron model in several layouts, over a `NetworkCopyTransport` to one rollout node's receiver
(a thread of rank 0, a directory standing for its /dev/shm) and a recording server (vLLM's patch
loader applies each round's patches, `tests/unit/test_sync_shm.EngineRecorder`).

Per layout: a whole sync, then about 1 % of each local shard's elements moved, then a delta sync,
then one with NaN in rank 1's parameters, one that rank 0's transport refuses to begin, and a whole
one to servers that cannot take patches in place.
Rank 0 reports whether each round was a delta, the changed fraction the owners counted and the
true one (from two whole gathers), and whether the server holds the whole gather's tensors bit
for bit.

`torchrun --nproc-per-node 2 tests/mp/owner_delta_worker.py HF_DIR LAYOUTS NODE_SHM OUT_JSON`
"""

from __future__ import annotations

import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.config.schema import TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.megatron.devices import from_rank0  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.rollout.engines.digest import tensor_digest  # noqa: E402
from megatron_rl.sync import OwnerSender, sync_weights  # noqa: E402
from megatron_rl.sync.network import CopyGroup, CopyGroupAddress, NetworkCopyTransport, NodeCopyReceiver  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from megatron_rl.weights.sharding import gather_hf_layers, local_params  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from layouts_worker import LAYOUTS  # noqa: E402

from tests.mp.common import finish, free_port  # noqa: E402
from tests.unit.test_sync_shm import EngineRecorder  # noqa: E402


def move_some(model: torch.nn.Module, frac: float = 0.01) -> None:
    """About `frac` of every local shard's elements moved (seeded by name and TP rank, so each
    shard moves the same on every replica)."""
    with torch.no_grad():
        for p in local_params(model):
            g = torch.Generator().manual_seed(zlib.crc32(f"{p.global_name}/{p.tp_rank}".encode()))
            flat = p.param.data.view(-1)
            hit = torch.rand(flat.numel(), generator=g) < frac
            flat[hit] += 0.01


def errors(sync: Callable[[], object]) -> list[str]:
    """Every rank's error of `sync()` ('no error'), gathered: the group is usable afterwards only if
    every rank stopped at one place."""
    try:
        sync()
        said = "no error"
    except RuntimeError as exc:
        said = str(exc)
    out: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(out, said)
    return out


def nan_sync(model: torch.nn.Module, adapter: object, transport: object) -> list[str]:
    """A NaN in the first element of every parameter of rank 1 only, then a sync (rank 1 owns parts
    of its own, its stage or its experts: it must not stop alone in the middle of the gather, with
    rank 0 waiting there and the servers paused); the weights are put back after."""
    params = [p.param.data.view(-1) for p in local_params(model)] if dist.get_rank() == 1 else []
    kept = [flat[0].item() for flat in params]
    with torch.no_grad():
        for flat in params:
            flat[0] = float("nan")
    try:
        return errors(lambda: sync_weights(model, adapter, transport, 3, torch.float32))
    finally:
        with torch.no_grad():
            for flat, value in zip(params, kept):
                flat[0] = value


def refused_begin(model: torch.nn.Module, adapter: object, transport: object) -> list[str]:
    """Rank 0's transport refuses to begin (as a server refusing /start_weight_update): every rank
    stops before the gather, told so by rank 0."""
    if dist.get_rank() == 0:
        def refuse(*args: object, **kwargs: object) -> None:
            raise RuntimeError("the servers refused the round")

        transport.begin = refuse                  # type: ignore[attr-defined]
    try:
        return errors(lambda: sync_weights(model, adapter, transport, 4, torch.float32))
    finally:
        if dist.get_rank() == 0:
            del transport.begin                   # type: ignore[attr-defined]


def whole_without_copies(model: torch.nn.Module, adapter: object, transport: object) -> dict[str, object]:
    """A transport whose servers cannot take patches in place (`in_place_refusal`, as nccl's): the
    round goes whole and the owners keep no host copies for deltas that will not come."""
    if dist.get_rank() == 0:
        transport.in_place_refusal = "a server's MoE kernel"          # type: ignore[attr-defined]
    report = sync_weights(model, adapter, transport, 5, torch.float32)
    held: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(held, len(transport.owners.held))          # type: ignore[attr-defined]
    return {"held": held, "sent": None if report is None else report.sent}


def whole(model: torch.nn.Module, adapter: object) -> dict[str, torch.Tensor]:
    """Every HF tensor on rank 0 ({} elsewhere), through the one gather every export uses."""
    return {name: t.clone() for layer in gather_hf_layers(model, adapter) for name, t in layer}


def one_layout(hf_dir: str, hf: dict, name: str, node_shm: Path) -> dict | None:
    init_parallel(LAYOUTS[name], seed=1)
    adapter = weight_map(hf)
    actor = Actor(build_model(hf, LAYOUTS[name], torch.float32), 2,
                  Training(TrainerConfig(lr=1e-2), LAYOUTS[name], total_updates=10))
    model = actor.model
    load_hf_into_model(model, hf_dir, adapter)
    rank0 = dist.get_rank() == 0
    port = from_rank0(free_port())
    address = CopyGroupAddress("127.0.0.1", port, 2, 60.0)
    server = EngineRecorder("node")
    receiver: list[NodeCopyReceiver] = []
    thread = None
    if rank0:
        (node_shm / name).mkdir(parents=True)

        def receive() -> None:
            receiver.append(NodeCopyReceiver(CopyGroup(address, 1), 1 << 16, node_shm / name))
            receiver[0].serve()

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
    transport = NetworkCopyTransport([server], CopyGroup(address, 0), segment_bytes=1 << 16, delta="auto") \
        if rank0 else OwnerSender()
    try:
        before = whole(model, adapter)
        first = sync_weights(model, adapter, transport, 1, torch.float32)
        move_some(model)
        after = whole(model, adapter)
        second = sync_weights(model, adapter, transport, 2, torch.float32)
        digests_after_second = {n: tensor_digest(t) for n, t in server.loaded.items()}
        patched = server.patched
        stopped = nan_sync(model, adapter, transport)
        refused = refused_begin(model, adapter, transport)
        plain = whole_without_copies(model, adapter, transport)
        held_after_plain = {n: tensor_digest(t) for n, t in server.loaded.items()} == \
            {n: tensor_digest(t) for n, t in after.items()}
    finally:
        if rank0:
            transport.close()
            assert thread is not None
            thread.join(timeout=60)
    if not rank0:
        return None
    assert first is not None and second is not None and first.sent is not None and second.sent is not None
    bits = {n: (t.view(torch.int32) != before[n].view(torch.int32)).sum().item() for n, t in after.items()}
    held = digests_after_second
    return {"dense": [first.sent["dense"], second.sent["dense"]], "bytes": [first.sent["bytes"], second.sent["bytes"]],
            "changed_frac": second.sent["changed_frac"],
            "true_frac": sum(bits.values()) / sum(t.numel() for t in after.values()),
            "bit_identical": held == {n: tensor_digest(t) for n, t in after.items()},
            "tensors": len(after), "patched": patched, "changed_tensors": sum(1 for b in bits.values() if b),
            "receiver_alive": bool(thread is not None and thread.is_alive()), "nan_stopped": stopped,
            "refused": refused, "plain": plain, "plain_identical": held_after_plain}


def main() -> None:
    hf_dir, layouts, node_shm, out = sys.argv[1:5]
    hf = read_hf_config(hf_dir)
    result = {name: one_layout(hf_dir, hf, name, Path(node_shm)) for name in layouts.split(",")}
    finish(result, out)


if __name__ == "__main__":
    main()
