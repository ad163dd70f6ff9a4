"""torchrun worker: the QLoRA spec's checks (tests/helpers/qlora.py) on the tiny Qwen3-MoE, on the
device this rank is bound to — CUDA in tests/gpu/test_qlora_gpu.py (1 GPU, TP 1: TE's norms and
attention where TE is installed), the CPU on gloo in tests/integration/test_qlora_layouts.py (2
ranks, TP 2 + sequence parallelism).

`torchrun --nproc-per-node N tests/mp/qlora_worker.py OUT_JSON [QWEN3_NEXT_HF_DIR]` (N = 1: TP 1;
N = 2: TP 2 + SP, expert-TP 1) writes, on rank 0, every rank's results as a JSON list. With the HF
directory of a tiny Qwen3-Next, each rank also loads it into a QLoRA model at that layout and
reports each NF4 shard's error against the dense model's (`qwen3_next_load`).
"""

from __future__ import annotations

import importlib.util
import sys

import torch
import yaml

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: a no-op with CUDA

import torch.distributed as dist  # noqa: E402

from megatron_rl.config.schema import ParallelismConfig  # noqa: E402
from megatron_rl.megatron.actor import init_parallel  # noqa: E402
from megatron_rl.megatron.devices import compute_device, init_distributed  # noqa: E402
from megatron_rl.megatron.gpt import use_transformer_engine  # noqa: E402
from megatron_rl.megatron.quantize import is_quantized  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from tests.helpers import qlora  # noqa: E402
from tests.mp.common import finish  # noqa: E402
from tests.mp.launch import REPO  # noqa: E402

TINY_MOE = yaml.safe_load((REPO / "recipes/tiny/base.yaml").read_text())["model"]["tiny"]
LAYOUTS = {1: ParallelismConfig(),
           2: ParallelismConfig(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)}


def run(dtype: torch.dtype, device: torch.device, layout: ParallelismConfig) -> dict:
    quant, report = qlora.qlora_model(TINY_MOE, dtype, device, layout)
    twin = qlora.float64_twin(TINY_MOE, quant, device, layout)
    out = qlora.forward_and_grads(quant, twin, qlora.tokens(TINY_MOE["vocab_size"], device))
    nf4 = [p for p in quant.parameters() if is_quantized(p)]
    out.update(
        nf4_holder_classes=sorted(set(qlora.nf4_holders(quant).values())), nf4_modules=len(report.quantized),
        te_classes=qlora.te_classes(quant), trainable=sum(p.requires_grad for p in quant.parameters()),
        param_devices=sorted({str(p.device) for p in quant.parameters()}),
        nf4_storage_devices=sorted({str(p.quantized_data.device) for p in nf4}),   # type: ignore[attr-defined]
    )
    if dtype == torch.float32:
        out["sync"] = qlora.merged_sync(TINY_MOE, quant, twin, dtype)
    return out


def main() -> None:
    out_json = sys.argv[1]
    init_distributed()
    layout = LAYOUTS[dist.get_world_size()]
    init_parallel(layout, seed=3)
    device = compute_device()
    mine: dict = {"device": str(device), "te": use_transformer_engine(),
                  "te_installed": importlib.util.find_spec("transformer_engine") is not None}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        mine[name] = run(dtype, device, layout)
    if len(sys.argv) > 2:
        next_dir = sys.argv[2]
        mine["qwen3_next_load"] = qlora.hf_load_errors(read_hf_config(next_dir), next_dir, device, layout)
    if device.type == "cuda":
        mine["dequantize_peak_bytes_per_param_bf16"] = qlora.dequantize_peak_bytes_per_param(device, torch.bfloat16)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    finish(everyone, out_json)


if __name__ == "__main__":
    main()
