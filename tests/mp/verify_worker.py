"""torchrun worker: sync a Megatron actor into a running rollout server (any TP) in a given dtype,
then measure the verification statistics after a correct sync, after a training step (stale
server, then synced again), and after a sync that corrupts one tensor; also generate from the
synced server and compare the sampled tokens' log-probs with the trainer's.

`torchrun --nproc-per-node N tests/mp/verify_worker.py HF_DIR URL TOKEN_FILE DTYPE LAYOUT CORRUPT OUT_JSON`
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.config.schema import AlgorithmConfig, RolloutConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.rollout.client import RolloutClient  # noqa: E402
from megatron_rl.rollout.server import RolloutServer  # noqa: E402
from megatron_rl.sync import sync_weights  # noqa: E402
from megatron_rl.sync import verify as verification  # noqa: E402
from megatron_rl.sync.shm import SharedSegmentTransport  # noqa: E402
from megatron_rl.types import TrainBatch  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from layouts_worker import LAYOUTS, make_batch  # noqa: E402

from tests.mp.common import finish  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SEGMENT_BYTES = RolloutConfig().sync_bucket_mb << 20
"""What a training run passes the transport (`rollout.sync_bucket_mb`, the schema's default)."""


class SwapRowsTransport(SharedSegmentTransport):
    """Swaps the two row halves of one tensor on its way to the server: the kind of error a wrong
    tensor-parallel shard order makes."""

    corrupt = ""

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.corrupt in tensors:
            t = tensors[self.corrupt]
            tensors = dict(tensors, **{self.corrupt: torch.cat(t.chunk(2, dim=0)[::-1])})
        super().send_bucket(tensors)


def probe(vocab: int, rows: int = 4, length: int = 40) -> TrainBatch:
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(rows, length - 1)
    mask[:, 8:] = 1.0                      # a prompt of 9 tokens, then 31 verified tokens per row
    return TrainBatch(tokens=torch.randint(3, vocab, (rows, length), generator=g), mask=mask,
                      advantages=torch.zeros(rows))


def stats_of(actor: Actor, client: RolloutClient | None, batch: TrainBatch) -> list[float]:
    trainer = actor.compute_logprobs(batch, temperature=1.0)
    stats = torch.zeros(len(verification.STATS), dtype=torch.float64)
    if client is not None:
        stats = verification.diff_stats(verification.server_diffs(trainer, batch, [client]))
    dist.broadcast(stats, src=0)
    return [float(x) for x in stats]


def generated_gap(actor: Actor, client: RolloutClient | None, vocab: int) -> dict[str, float]:
    """Sample from the server (T = 1), then |Δ| between its sampled-token log-probs and the trainer's."""
    box: list = [None]
    if client is not None:
        prompts = [[5, 9, 17, 33, 65, 3, 7, 11], [2, 4, 8, 16, 32, 64, 128, 200]]
        sampling = RolloutConfig(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_response_length=12)
        box[0] = client.generate(prompts, sampling)
    dist.broadcast_object_list(box, src=0)
    samples = [s for group in box[0] for s in group]
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    tokens = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length - 1)
    server = torch.zeros(len(samples), length - 1)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        tokens[i, :len(seq)] = torch.tensor(seq)
        start = len(s.prompt_ids) - 1
        mask[i, start:start + len(s.response_ids)] = 1.0
        server[i, start:start + len(s.response_ids)] = torch.tensor(s.response_logprobs)
    trainer = actor.compute_logprobs(TrainBatch(tokens, mask, torch.zeros(len(samples))), temperature=1.0)
    diff = (trainer - server).abs()[mask > 0]
    return {"samples": len(samples), "tokens": int(mask.sum()), "mean": float(diff.mean()), "max": float(diff.max())}


def main() -> None:
    hf_dir, url, token_file, dtype_name, layout, corrupt, out = sys.argv[1:8]
    dtype = DTYPES[dtype_name]
    hf = read_hf_config(hf_dir)
    init_parallel(LAYOUTS[layout], seed=1)
    handle = client = None
    if dist.get_rank() == 0:
        host, port = url.rsplit(":", 1)
        handle = RolloutServer(hf_dir, Path("/tmp"), RolloutConfig(host=host.split("//")[1]), 64,
                               token=Path(token_file).read_text(), port=int(port))
        client = RolloutClient(url, handle.token, "policy", RolloutConfig(), stop_token_ids=[])
    actor = Actor(build_model(hf, LAYOUTS[layout], dtype), 2,
                  Training(TrainerConfig(lr=1e-3), LAYOUTS[layout], total_updates=10))
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    adapter, batch = weight_map(hf), probe(hf["vocab_size"])
    # Through vLLM's weight-transfer routes (the `mrl_shm` engine), as a training run syncs.
    good = SharedSegmentTransport([handle], segment_bytes=SEGMENT_BYTES) if handle else None
    bad = SwapRowsTransport([handle], segment_bytes=SEGMENT_BYTES) if handle else None
    if bad:
        bad.corrupt = corrupt
    result: dict = {"stats": list(verification.STATS)}
    report = sync_weights(actor.model, adapter, good, 1, dtype)
    result["server_report"] = report.server if report else None
    result["initial"] = stats_of(actor, client, batch)
    result["generated"] = generated_gap(actor, client, hf["vocab_size"])
    train = make_batch(hf["vocab_size"])
    train.old_logprobs = actor.compute_logprobs(train, 1.0)
    actor.train_step(train, AlgorithmConfig(), temperature=1.0, rl_step=0)
    result["stale"] = stats_of(actor, client, batch)
    sync_weights(actor.model, adapter, good, 2, dtype)
    result["trained"] = stats_of(actor, client, batch)
    sync_weights(actor.model, adapter, bad, 3, dtype)
    result["corrupted"] = stats_of(actor, client, batch)
    limits = verification.LIMITS[dtype]
    for key in ("initial", "stale", "trained", "corrupted"):
        result[f"{key}_failure"] = verification.failure(torch.tensor(result[key]), limits)
    if good:
        good.close()
        bad.close()
    finish(result, out)


if __name__ == "__main__":
    main()
