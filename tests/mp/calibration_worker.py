"""torchrun worker: the self-calibrating verification gate against a real server in bf16, on a model
whose logits are as large as a real checkpoint's. Measures (1) the fixed bf16 bounds on a forced
probe with the server's own load of the checkpoint (same weights), (2) the noise floor on sampled
tokens, the gate it sets, then the gate after a correct sync, after a training step and sync, and
after syncs that corrupt one tensor each (then a correct sync again). After the correct sync and
after each corrupting one, the diagnosis of a failed gate (`sync/diagnose.py`): the weights re-sent
through the same transport with both sides checksumming.

`torchrun --nproc-per-node 1 tests/mp/calibration_worker.py HF_DIR URL TOKEN_FILE OUT_JSON CORRUPT...`
"""

from __future__ import annotations

import json
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
from megatron_rl.sync import Transport, sync_weights  # noqa: E402
from megatron_rl.sync import verify as verification  # noqa: E402
from megatron_rl.sync.diagnose import diagnose_sync  # noqa: E402
from megatron_rl.sync.shm import SharedSegmentTransport  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from megatron_rl.weights.map import WeightAdapter  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from layouts_worker import LAYOUTS, make_batch  # noqa: E402
from verify_worker import SEGMENT_BYTES, SwapRowsTransport, probe, stats_of  # noqa: E402


def sampled(client: RolloutClient | None, vocab: int) -> object:
    """The calibrated probe: 4 prompts, each with what the server sampled (T = 1)."""
    box: list = [None]
    if client is not None:
        g = torch.Generator().manual_seed(11)
        prompts = [torch.randint(3, vocab, (9,), generator=g).tolist() for _ in range(4)]
        settings = RolloutConfig(n=1, temperature=1.0, top_p=1.0, top_k=-1,
                                 max_response_length=verification.PROBE_TOKENS)
        responses = [group[0].response_ids for group in client.generate(prompts, settings)]
        box[0] = verification.sampled_probe(prompts, responses, 9 + verification.PROBE_TOKENS, 0)
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None, "the server sampled too few tokens"
    return box[0]


def diagnosed(actor: Actor, adapter: WeightAdapter, transport: Transport | None, handle: RolloutServer | None,
              version: int, dtype: torch.dtype) -> dict:
    """The diagnosis the run makes when the gate fails, re-sending `version` through `transport`."""
    d = diagnose_sync(lambda t: sync_weights(actor.model, adapter, t, version, dtype), transport,
                      [handle] if handle else [])
    return {"message": d.message(), "families": d.families(), "workers": len(d.workers), "sent": d.sent,
            "error": d.error, "seconds": d.seconds}


def main() -> None:
    hf_dir, url, token_file, out, *corrupt = sys.argv[1:]
    dtype = torch.bfloat16
    hf = read_hf_config(hf_dir)
    layout = LAYOUTS["tp1"]
    init_parallel(layout, seed=1)
    handle = client = None
    if dist.get_rank() == 0:
        host, port = url.rsplit(":", 1)
        handle = RolloutServer(hf_dir, Path("/tmp"), RolloutConfig(host=host.split("//")[1]), 64,
                               token=Path(token_file).read_text(), port=int(port))
        client = RolloutClient(url, handle.token, "policy", RolloutConfig(), stop_token_ids=[])
    actor = Actor(build_model(hf, layout, dtype), 2, Training(TrainerConfig(lr=1e-3), layout, total_updates=10))
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    adapter = weight_map(hf)
    result: dict = {"stats": list(verification.STATS)}
    # (1) The fixed bounds, forced tokens, the server's own load (no sync: same weights).
    forced = stats_of(actor, client, probe(hf["vocab_size"]))
    result["forced_same_weights"] = forced
    result["forced_fixed_failure"] = verification.failure(torch.tensor(forced), verification.LIMITS[dtype])
    # (2) The calibrated gate: the floor on sampled tokens, same weights.
    batch = sampled(client, hf["vocab_size"])
    result["probe_tokens"] = int(batch.mask.sum())
    floor = stats_of(actor, client, batch)
    gate = verification.calibrate(torch.tensor(floor), dtype, None)
    result["floor"], result["limits"] = floor, [gate.limits.mean, gate.limits.p90]
    result["startup_failure"] = verification.failure(torch.tensor(floor),
                                                     verification.startup_limits(dtype, None))
    good = SharedSegmentTransport([handle], segment_bytes=SEGMENT_BYTES) if handle else None
    bad = SwapRowsTransport([handle], segment_bytes=SEGMENT_BYTES) if handle else None
    version = 1
    sync_weights(actor.model, adapter, good, version, dtype)
    result["synced"] = stats_of(actor, client, batch)
    result["diagnosis synced"] = diagnosed(actor, adapter, good, handle, version, dtype)
    train = make_batch(hf["vocab_size"])
    train.old_logprobs = actor.compute_logprobs(train, 1.0)
    actor.train_step(train, AlgorithmConfig(), temperature=1.0, rl_step=0)
    version += 1
    sync_weights(actor.model, adapter, good, version, dtype)
    result["trained"] = stats_of(actor, client, batch)
    for name in corrupt:
        if bad:
            bad.corrupt = name
        version += 1
        sync_weights(actor.model, adapter, bad, version, dtype)
        result[f"corrupted {name}"] = stats_of(actor, client, batch)
        result[f"diagnosis {name}"] = diagnosed(actor, adapter, bad, handle, version, dtype)
        version += 1
        sync_weights(actor.model, adapter, good, version, dtype)
        result[f"restored after {name}"] = stats_of(actor, client, batch)
    for key in [k for k in result if k.startswith(("synced", "trained", "corrupted", "restored"))]:
        result[f"{key}_failure"] = verification.failure(torch.tensor(result[key]), gate.limits)
    if good and bad:
        good.close()
        bad.close()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
