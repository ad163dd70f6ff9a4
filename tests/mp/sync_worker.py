"""torchrun worker: sync a Megatron actor (several layouts) into a running rollout server and
check the server's log-probs against the trainer's.

`torchrun --nproc-per-node 2 tests/mp/sync_worker.py HF_DIR SERVER_URL TOKEN_FILE LAYOUTS OUT_JSON`
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.config.schema import (  # noqa: E402
    AlgorithmConfig,
    RolloutConfig,
    TrainerConfig,
)
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.rollout.client import RolloutClient  # noqa: E402
from megatron_rl.rollout.server import RolloutServer  # noqa: E402
from megatron_rl.sync import sync_weights  # noqa: E402
from megatron_rl.sync.shm import SharedSegmentTransport  # noqa: E402
from megatron_rl.types import TrainBatch  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from layouts_worker import LAYOUTS, make_batch  # noqa: E402

from tests.mp.common import finish  # noqa: E402


class CorruptingTransport(SharedSegmentTransport):
    """Adds noise to one tensor on its way to the server: the verification must notice."""

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        name = sorted(tensors)[len(tensors) // 2]
        tensors = dict(tensors, **{name: tensors[name] + 0.05})
        super().send_bucket(tensors)


def server_diff(actor: Actor, client: RolloutClient | None, probe: TrainBatch) -> float:
    trainer = actor.compute_logprobs(probe, temperature=1.0).cpu()
    diff = torch.zeros(())
    if client is not None:
        server = client.prompt_logprobs([row.tolist() for row in probe.tokens])
        diff = (torch.tensor(server) - trainer).abs().max()
    # NCCL (the GPU tests) takes CUDA tensors only.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    diff = diff.to(device)
    dist.broadcast(diff, src=0)
    return float(diff)


def main() -> None:
    hf_dir, url, token_file, layouts, out = sys.argv[1:6]
    hf = read_hf_config(hf_dir)
    adapter = weight_map(hf)
    rank0 = dist.get_rank() == 0 if dist.is_initialized() else None
    g = torch.Generator().manual_seed(3)
    probe = TrainBatch(tokens=torch.randint(3, 290, (4, 20), generator=g), mask=torch.ones(4, 19),
                       advantages=torch.zeros(4))
    result = {}
    version = 0
    for name in layouts.split(","):
        init_parallel(LAYOUTS[name], seed=1)
        rank0 = dist.get_rank() == 0
        handle = client = None
        if rank0:
            host, port = url.rsplit(":", 1)
            handle = RolloutServer(hf_dir, Path("/tmp"), RolloutConfig(host=host.split("//")[1]), 64,
                                   token=Path(token_file).read_text(), port=int(port))
            client = RolloutClient(url, handle.token, "policy", RolloutConfig(), stop_token_ids=[])   # log-probs only
        actor = Actor(build_model(hf, LAYOUTS[name], torch.float32), 2,
                      Training(TrainerConfig(lr=1e-2), LAYOUTS[name], total_updates=10))
        load_hf_into_model(actor.model, hf_dir, adapter)
        actor.optimizer.reload_model_params()
        batch = make_batch(hf["vocab_size"])
        batch.old_logprobs = actor.compute_logprobs(batch, 1.0)
        entry = {}
        # One transport for both good syncs: the second rewrites the first one's segments in place
        # (64 KiB segments: really split). A fresh one for the corrupted sync.
        good = SharedSegmentTransport([handle], segment_bytes=1 << 16) if rank0 else None
        for attempt in ("first", "second", "corrupted"):
            actor.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=0)   # the server is now stale
            entry[f"{attempt}_before_sync"] = server_diff(actor, client, probe)
            transport = (CorruptingTransport([handle], segment_bytes=1 << 16) if attempt == "corrupted" else good) \
                if rank0 else None
            version += 1
            report = sync_weights(actor.model, adapter, transport, version, torch.float32)
            entry[f"{attempt}_after_sync"] = server_diff(actor, client, probe)
            if rank0:
                entry[f"{attempt}_segments"] = len(transport.layout.sizes)
                entry[f"{attempt}_segment_files"] = sorted(str(f.path) for f in transport.files)
                entry[f"{attempt}_server"] = report.server
        if rank0:
            good.close()
            transport.close()
        result[name] = entry
    finish(result, out)


if __name__ == "__main__":
    main()
