"""torchrun worker: LoRA sync into a running rollout server (only the merged adapted tensors)
and the server's log-probs against the trainer's adapted model.

`torchrun --nproc-per-node 2 tests/mp/lora_sync_worker.py HF_DIR SERVER_URL TOKEN_FILE LAYOUTS OUT_JSON [experts]`
(with `experts`: adapters on every routed expert too, so the update carries whole MoE blocks)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

import torch.distributed as dist  # noqa: E402

from megatron_rl.config.schema import RolloutConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.rollout.client import RolloutClient  # noqa: E402
from megatron_rl.rollout.server import RolloutServer  # noqa: E402
from megatron_rl.sync.lora import sync_lora  # noqa: E402
from megatron_rl.sync.shm import SharedSegmentTransport  # noqa: E402
from megatron_rl.types import TrainBatch  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from tests.mp.common import finish  # noqa: E402
from tests.mp.layouts_worker import LAYOUTS, make_batch  # noqa: E402
from tests.mp.lora_layouts_worker import ALGO, LORA, LORA_EXPERTS  # noqa: E402
from tests.mp.sync_worker import server_diff  # noqa: E402


def main() -> None:
    hf_dir, url, token_file, layouts, out = sys.argv[1:6]
    lora = LORA_EXPERTS if sys.argv[6:] == ["experts"] else LORA
    hf = read_hf_config(hf_dir)
    adapter = weight_map(hf)
    g = torch.Generator().manual_seed(3)
    probe = TrainBatch(tokens=torch.randint(3, 290, (4, 20), generator=g), mask=torch.ones(4, 19),
                       advantages=torch.zeros(4))
    result, version = {}, 0
    for name in layouts.split(","):
        init_parallel(LAYOUTS[name], seed=1)
        rank0 = dist.get_rank() == 0
        handle = client = transport = None
        if rank0:
            host, port = url.rsplit(":", 1)
            handle = RolloutServer(hf_dir, Path("/tmp"), RolloutConfig(host=host.split("//")[1]), 64,
                                   token=Path(token_file).read_text(), port=int(port))
            client = RolloutClient(url, handle.token, "policy", RolloutConfig(), stop_token_ids=[])   # log-probs only
            transport = SharedSegmentTransport([handle], segment_bytes=1 << 16)
        actor = Actor(build_model(hf, LAYOUTS[name], torch.float32), 2,
                      Training(TrainerConfig(lr=3e-2), LAYOUTS[name], total_updates=10), lora=lora)
        load_hf_into_model(actor.model, hf_dir, adapter)
        actor.optimizer.reload_model_params()
        batch = make_batch(hf["vocab_size"])
        batch.old_logprobs = actor.compute_logprobs(batch, 1.0)
        batch.ref_logprobs = batch.old_logprobs.clone()
        entry: dict = {}
        for attempt in range(3):
            actor.train_step(batch, ALGO, temperature=1.0, rl_step=attempt)     # the server is now stale
            entry[f"before_{attempt}"] = server_diff(actor, client, probe)
            version += 1
            report = sync_lora(actor.model, adapter, transport, version, torch.float32)
            entry[f"after_{attempt}"] = server_diff(actor, client, probe)
            if report is not None:
                entry[f"server_{attempt}"] = report.server
                entry[f"tensors_{attempt}"] = report.tensors
                entry[f"mb_{attempt}"] = report.bytes / 2**20
        if transport is not None:
            transport.close()
        result[name] = entry
    finish(result, out)


if __name__ == "__main__":
    main()
