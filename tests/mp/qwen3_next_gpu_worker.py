"""torchrun worker: a tiny Qwen3-Next on one rank, on the device it is bound to.

`torchrun --nproc-per-node 1 tests/mp/qwen3_next_gpu_worker.py HF_DIR OUT_JSON [SERVER_URL TOKEN_FILE]`

With CUDA hidden (the float64 twin of tests/gpu/test_qwen3_next_gpu.py): the CPU path, local spec,
megatron's torch delta rule (`deterministic_mode`), float64; writes the probe's log-probs.

On a GPU: the production spec (megatron's hybrid builder: TE linears with fused norms, our GDN
class, fla's causal_conv1d and chunk_gated_delta_rule) in fp32, loaded from HF; writes what was
built, the probe's log-probs, one GRPO optimizer step, and with SERVER_URL a sync into that vLLM
server (the `shm` transport, the production recipes' one) with its log-probs before and after.
`--as-gpu` runs those GPU steps on the CPU (the local spec, a CPU vLLM server): the plumbing and the
bf16 magnitudes, measured so, not the GPU spec.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

torch.set_num_threads(4)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core (a no-op with CUDA)

from megatron_rl.config.schema import AlgorithmConfig, RolloutConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel, unwrap  # noqa: E402
from megatron_rl.megatron.devices import init_distributed  # noqa: E402
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


def probe(vocab: int) -> TrainBatch:
    """4 rows × 40 tokens, every next token verified (T = 1)."""
    g = torch.Generator().manual_seed(11)
    return TrainBatch(tokens=torch.randint(3, vocab, (4, 40), generator=g), mask=torch.ones(4, 39),
                      advantages=torch.zeros(4))


def gdn_layers(actor: Actor) -> list[Any]:
    return [layer.self_attention for layer in unwrap(actor.model).decoder.layers
            if hasattr(layer.self_attention, "in_proj")]


def count_calls(module: Any, attr: str, counts: dict[str, int]) -> None:
    """Count the calls of `module.attr` (an instance attribute: what forward calls)."""
    fn = getattr(module, attr)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[attr] = counts.get(attr, 0) + 1
        return fn(*args, **kwargs)

    setattr(module, attr, counted)


def built(actor: Actor) -> dict[str, Any]:
    gdn = gdn_layers(actor)
    return {"deterministic_mode": bool(actor.config.deterministic_mode),
            "gdn_classes": sorted({type(m).__name__ for m in gdn}),
            "in_proj_classes": sorted({type(m.in_proj).__name__ for m in gdn}),
            "delta_rule_modules": sorted({m.gated_delta_rule.__module__ for m in gdn}),
            "attention_linear_classes": sorted({type(layer.self_attention.linear_qkv).__name__
                                                for layer in unwrap(actor.model).decoder.layers
                                                if hasattr(layer.self_attention, "linear_qkv")}),
            "param_devices": sorted({str(p.device) for p in actor.model.parameters()})}


def twin(hf_dir: str, out: str) -> None:
    hf = read_hf_config(hf_dir)
    actor = Actor(build_model(hf, LAYOUTS["tp1"], torch.float64), 1, None)
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    finish({"logprobs": actor.compute_logprobs(probe(hf["vocab_size"]), 1.0).tolist(), **built(actor)}, out)


def server_logprobs(client: RolloutClient | None, batch: TrainBatch) -> list[list[float]] | None:
    return None if client is None else client.prompt_logprobs([row.tolist() for row in batch.tokens])


def gpu(hf_dir: str, out: str, url: str | None, token_file: str | None) -> None:
    hf = read_hf_config(hf_dir)
    adapter = weight_map(hf)
    actor = Actor(build_model(hf, LAYOUTS["tp1"], torch.float32), 2,
                  Training(TrainerConfig(lr=1e-2), LAYOUTS["tp1"], total_updates=10))
    load_hf_into_model(actor.model, hf_dir, adapter)
    actor.optimizer.reload_model_params()
    result: dict[str, Any] = built(actor)
    counts: dict[str, int] = {}
    for m in gdn_layers(actor):
        count_calls(m, "gated_delta_rule", counts)
    check = probe(hf["vocab_size"])
    result["logprobs"] = actor.compute_logprobs(check, 1.0).cpu().tolist()
    result["delta_rule_calls"] = counts.get("gated_delta_rule", 0)
    handle = client = None
    if url is not None and token_file is not None:
        host, port = url.rsplit(":", 1)
        handle = RolloutServer(hf_dir, Path("/tmp"), RolloutConfig(host=host.split("//")[1]), 64,
                               token=Path(token_file).read_text(), port=int(port))
        client = RolloutClient(url, handle.token, "policy", RolloutConfig(), stop_token_ids=[])
        result["server_at_load"] = server_logprobs(client, check)
    before = {n: p.detach().float().cpu().clone() for n, p in actor.model.named_parameters()}
    batch = make_batch(hf["vocab_size"])
    batch.old_logprobs = actor.compute_logprobs(batch, 1.0)
    step = actor.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=0)
    result["step"] = {k: float(v) for k, v in step.items() if isinstance(v, (int, float))}
    moved = {n: float((p.detach().float().cpu() - before[n]).abs().max()) for n, p in actor.model.named_parameters()}
    result["moved_gdn"] = sorted(n for n, d in moved.items() if d > 0 and ".in_proj." in n)
    result["unmoved"] = sorted(n for n, d in moved.items() if d == 0)
    result["logprobs_after_step"] = actor.compute_logprobs(check, 1.0).cpu().tolist()
    if handle is not None:
        result["server_before_sync"] = server_logprobs(client, check)
        transport = SharedSegmentTransport([handle], segment_bytes=1 << 20)
        try:
            report = sync_weights(actor.model, adapter, transport, 1, torch.bfloat16)
        finally:
            transport.close()
        result["sync"] = report.server
        result["server_after_sync"] = server_logprobs(client, check)
    finish(result, out)


def main() -> None:
    init_distributed()
    init_parallel(LAYOUTS["tp1"], seed=1)
    args = [a for a in sys.argv[1:] if a != "--as-gpu"]
    if not torch.cuda.is_available() and "--as-gpu" not in sys.argv:   # --as-gpu: the GPU steps on the CPU
        twin(args[0], args[1])
    else:
        gpu(args[0], args[1], *(args[2:4] if len(args) >= 4 else (None, None)))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
