"""Trainer memory of full, LoRA and QLoRA training on one tiny-but-wide model, next to the planner.

Each mode runs in a fresh process (one rank; gloo on CPU, NCCL on a GPU): the real Megatron actor
(`Actor` with `lora=`: `megatron/lora.py` adapters on q/k/v/o, `megatron/quantize.py` NF4 base) takes
one GRPO optimizer step, so Adam's states exist. Measured, in bytes actually allocated:

* params: every parameter's storage (an NF4 weight counted by its codes, scales and factors);
* grads: megatron-core DDP's gradient buffers (fp32 main grads of the trained parameters);
* optimizer: every tensor in the Adam states (plus fp32 master copies when the model is bf16);
* rss / peak: the process's resident set growth from before the model was built to after the
  step, and its high-water mark (CPU), or the GPU's allocated and peak bytes. QLoRA's RSS also
  keeps what the full-precision base used before it was quantized (the model is built, then
  quantized; the C allocator keeps freed pages), so its RSS overstates the steady state.

The planner's prediction is `planner.plan.estimate` of the same model and LoRA settings (its
weights, gradients and optimizer terms); `ratio` = measured / predicted, target within 15 % for
the sum ("static"). RSS also holds activations, the allocator's slack and the Python process, which
the static sum does not. Usage:

    python bench/lora_memory.py [--hidden 1024] [--experts 8] [--rank 8] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import emit  # noqa: E402

MODES: dict[str, str | None] = {"full": None, "lora": "none", "qlora": "nf4"}
TOLERANCE = 0.15


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """Wide (hidden, experts) but shallow and short: the weights dominate, activations do not."""
    h = args.hidden
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=args.vocab,
                hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h, num_hidden_layers=args.layers,
                num_attention_heads=h // 128, num_key_value_heads=2, head_dim=128, num_experts=args.experts,
                num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=False)


def lora_config(mode: str, rank: int) -> Any:
    from megatron_rl.config.schema import LoraConfig

    quant = MODES[mode]
    return LoraConfig() if quant is None else LoraConfig(rank=rank, alpha=2.0 * rank, base_quantization=quant)


def predicted(args: argparse.Namespace, mode: str, fp32: bool) -> dict[str, float]:
    from megatron_rl.config.schema import ModelConfig, ParallelismConfig, RecipeConfig
    from megatron_rl.planner.memory import GB, Hardware
    from megatron_rl.planner.params import count_params
    from megatron_rl.planner.plan import estimate

    hf = model_fields(args)
    cfg = RecipeConfig(name=mode, model=ModelConfig(tiny=hf, params_dtype="fp32" if fp32 else "bf16",
                                                    reference="none"),
                       parallelism=ParallelismConfig(nodes=1, gpus_per_node=1), lora=lora_config(mode, args.rank))
    terms = {t.key: t.gb * GB for t in estimate(cfg, count_params(hf), Hardware(1, 80.0)).stage.terms}
    return {"params": terms["weights"], "grads": terms["gradients"], "optimizer": terms["optimizer"]}


def _storage_bytes(tensors: Any) -> int:
    from megatron_rl.megatron.quantize import tensor_nbytes

    seen: dict[int, int] = {}
    for t in tensors:
        if hasattr(t, "__tensor_flatten__"):
            seen[id(t)] = tensor_nbytes(t)
        elif t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measured(actor: Any) -> dict[str, int]:
    import torch

    ddp = actor.model
    buffers = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    opt_tensors: list[torch.Tensor] = []
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            opt_tensors += [v for k, v in state.items() if torch.is_tensor(v) and k != "step"]
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            opt_tensors += list(group)                   # fp32 master weights of a bf16 model
    return {"params": _storage_bytes(ddp.module.parameters()), "grads": grads,
            "optimizer": _storage_bytes(opt_tensors)}


def _rss() -> tuple[int, int]:
    """(resident, high-water mark) of this process in bytes (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()
    from megatron_rl.config.schema import AlgorithmConfig, ParallelismConfig, TrainerConfig
    from megatron_rl.megatron.actor import Actor, Training, init_parallel
    from megatron_rl.megatron.quantize import _torchao_nf4
    from megatron_rl.models import build_model
    from megatron_rl.types import TrainBatch

    cuda = torch.cuda.is_available()
    init_parallel(ParallelismConfig(), seed=1)
    _torchao_nf4()             # every mode loads the same code before the baseline
    rss0, _ = _rss()
    hf = model_fields(args)
    dtype = torch.bfloat16 if cuda else torch.float32
    actor = Actor(build_model(hf, ParallelismConfig(), dtype), 1,
                  Training(TrainerConfig(lr=1e-5), ParallelismConfig(), total_updates=10),
                  lora=lora_config(mode, args.rank))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, hf["vocab_size"], (args.rows, args.length), generator=g)
    mask = torch.zeros(args.rows, args.length - 1)
    mask[:, args.length // 2:] = 1.0
    batch = TrainBatch(tokens=tokens, mask=mask, advantages=torch.randn(args.rows, generator=g))
    batch.old_logprobs = actor.compute_logprobs(batch, temperature=1.0)
    metrics = actor.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=0)
    rss1, hwm = _rss()
    out: dict[str, Any] = {"measured": measured(actor), "loss": metrics["loss/total"],
                           "trainable_params": sum(p.numel() for p in actor.model.parameters() if p.requires_grad)}
    if cuda:
        out["gpu_allocated"], out["gpu_peak"] = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    else:
        out["rss_growth"], out["rss_peak"] = rss1 - rss0, hwm
    out["predicted"] = predicted(args, mode, fp32=not cuda)
    return out


def _spawn(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("child", "json_out")]
    done = subprocess.run([sys.executable, __file__, "--child", mode, *flags], capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode != 0:
        return {"failed": done.stderr.strip()[-1500:] or f"exit code {done.returncode}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def compare(result: dict[str, Any]) -> dict[str, Any]:
    m, p = result["measured"], result["predicted"]
    ratios = {k: m[k] / p[k] if p[k] else None for k in m}
    static_m, static_p = sum(m.values()), sum(p.values())
    ratios["static"] = static_m / static_p
    return {"measured_static_bytes": static_m, "predicted_static_bytes": round(static_p),
            "ratio": ratios, "within_tolerance": abs(ratios["static"] - 1) <= TOLERANCE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--child", choices=tuple(MODES))
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_mode(args.child, args)))
        return
    started = time.perf_counter()
    out: dict[str, Any] = {"model": model_fields(args), "rank": args.rank, "tolerance": TOLERANCE, "modes": {}}
    for mode in MODES:
        result = _spawn(mode, args)
        out["modes"][mode] = result if "failed" in result else {**result, **compare(result)}
    full = out["modes"]["full"].get("measured_static_bytes")
    for mode in ("lora", "qlora"):
        got = out["modes"][mode].get("measured_static_bytes")
        if full and got:
            out["modes"][mode]["static_vs_full"] = got / full
    emit(out, started, args.json_out)


if __name__ == "__main__":
    main()
