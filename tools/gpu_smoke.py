"""One-GPU smoke check of the trainer's GPU path; prints one JSON line.

Tiny Qwen3-MoE and Qwen3-Next actors (random weights, TP 1) in bf16 on CUDA (or on the CPU, so CI
keeps this script alive): every parameter of the actor and of a frozen reference on the device,
each micro-batch on the device inside the actor, log-probs against a float64 reference computed
from the same logits, a GRPO step that moves the weights, the NaN guard (a NaN gradient under a
finite loss skips the step and leaves the weights alone), and peak memory. Also the world group
(`cpu:gloo,cuda:nccl` on CUDA: a CPU and a device all-reduce), the device this rank is bound to
(LOCAL_RANK), and QLoRA (`qwen3_moe_qlora`: the actor builds the QLoRA spec — local linears holding
the frozen base in NF4 on the device, TE's norms and attention where TE is installed —, q/k/v/o
adapters; a step moves the adapters only).

Needs torch, megatron-core and what megatron-core 0.19.2 imports unconditionally: numpy and
packaging (megatron/core/utils.py, parallel_state.py, dist_checkpointing/strategies/torch.py), and
PyYAML; no vLLM, Transformer-Engine or transformers. Without one of them each model reports the
`ModuleNotFoundError` in the JSON line. For every model: einops and fla-core +
flash-linear-attention (`fla`: Qwen3-Next's Gated DeltaNet on CUDA; without it that model is
reported as skipped) and torchao (`qwen3_moe_qlora`'s NF4 base; skipped without it).
Run through tools/gpu_smoke.sh.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import socket
import sys
import time
import traceback
from typing import Any

import torch

QWEN3_MOE: dict[str, Any] = dict(
    architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
    moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_NEXT: dict[str, Any] = dict(
    architectures=["Qwen3NextForCausalLM"], vocab_size=256, hidden_size=64, num_hidden_layers=4,
    full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    partial_rotary_factor=0.25, rope_theta=1000000.0, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, intermediate_size=64,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False)
MODELS = {"qwen3_moe": QWEN3_MOE, "qwen3_next": QWEN3_NEXT, "qwen3_moe_qlora": QWEN3_MOE}
DEFAULT_MODELS = "qwen3_moe,qwen3_next,qwen3_moe_qlora"
LOGPROB_ATOL = 1e-4
"""Log-probs from the same logits, fp32 kernel vs float64: round-off only (measured ~1e-6)."""
TEMPERATURE = 0.9


def _world_of_one() -> None:
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _batch(vocab: int, rows: int = 4, length: int = 48, seed: int = 0) -> Any:
    from megatron_rl.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.zeros(rows, length - 1)
    mask[:, 8:] = 1.0
    return TrainBatch(tokens=tokens, mask=mask, advantages=torch.randn(rows, generator=g))


def _devices_of(model: torch.nn.Module) -> list[str]:
    """Devices of every parameter and buffer of the GPTModel (inside DDP, whose `buffers` are
    its gradient buckets)."""
    from megatron_rl.megatron.actor import unwrap

    module = unwrap(model)
    return sorted({str(t.device) for t in [*module.parameters(), *module.buffers()]})


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters, an NF4 base weight dequantized (torchao's NF4 clone re-quantizes
    with its default blocks, which a small tensor does not fill)."""
    return {n: (p.get_original_weight().float() if type(p).__name__ == "NF4Tensor" else p.detach()).clone()
            for n, p in model.named_parameters()}


def _logprob_check(actor: Any, batch: Any) -> float:
    """Max |Δ| of the actor's log-prob kernels (the chunked pass on the logits, and the fused head
    when the actor uses it) vs float64 on the same logits."""
    from megatron_rl.megatron.actor import unwrap

    tokens = batch.tokens.to(actor.device)
    actor.model.eval()          # two forwards: no (LoRA) dropout between them
    with torch.no_grad():
        logits = actor._logits(unwrap(actor.model), tokens)
        logp, _ = actor._logprobs(logits, tokens, TEMPERATURE, with_entropy=True)
        fused, _ = actor._logprobs(actor._head(unwrap(actor.model), tokens, TEMPERATURE, True), tokens,
                                   TEMPERATURE, with_entropy=True)
        ref = torch.log_softmax(logits.double() / TEMPERATURE, -1)[:, :-1].gather(
            -1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return max(float((lp.double() - ref).abs().max()) for lp in (logp, fused))


def world_group() -> dict[str, Any]:
    """The world group's backend, a CPU (gloo) and, with CUDA, a device (NCCL) all-reduce."""
    import torch.distributed as dist

    from megatron_rl.megatron.devices import compute_device

    device = compute_device()
    out: dict[str, Any] = {"backend": str(dist.get_backend()), "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
                           "bound_device": str(device)}
    for where in ["cpu"] + (["cuda"] if device.type == "cuda" else []):
        t = torch.ones(3, device=device if where == "cuda" else "cpu")
        dist.all_reduce(t)
        out[f"all_reduce_{where}"] = float(t.sum())
    return out


def _world_failures(r: dict[str, Any], device: str) -> list[str]:
    checks = {"the rank's own device": r["bound_device"] == device and
              (device == "cpu" or device == f"cuda:{r['local_rank']}"),
              "a CPU all-reduce": r["all_reduce_cpu"] == 3.0}
    if device != "cpu":
        checks["cpu:gloo,cuda:nccl world group"] = "cuda:nccl" in r["backend"] and "cpu:gloo" in r["backend"]
        checks["a device all-reduce (NCCL)"] = r.get("all_reduce_cuda") == 3.0
    return [f"world group: {what}" for what, ok in checks.items() if not ok]


def run_model(name: str, hf: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    from megatron_rl.config.schema import AlgorithmConfig, LoraConfig, ParallelismConfig, TrainerConfig
    from megatron_rl.megatron.actor import Actor, Training, init_parallel, unwrap
    from megatron_rl.megatron.gpt import use_transformer_engine
    from megatron_rl.models import build_model

    if name == "qwen3_next" and torch.cuda.is_available() and importlib.util.find_spec("fla") is None:
        return {"skipped": "flash-linear-attention (fla) is not installed; Qwen3-Next needs it on CUDA"}
    qlora = name.endswith("_qlora")
    if qlora and importlib.util.find_spec("torchao") is None:
        return {"skipped": "torchao (QLoRA's NF4) is not installed"}
    started = time.perf_counter()
    init_parallel(ParallelismConfig(), seed=1)
    recipe = build_model(hf, ParallelismConfig(), dtype)
    lora = LoraConfig(rank=8, alpha=16.0, targets=["q", "k", "v", "o"], base_quantization="nf4") if qlora else None
    actor = Actor(recipe, 2, Training(TrainerConfig(lr=1e-3), ParallelismConfig(), total_updates=4), lora=lora)
    actor.optimizer.reload_model_params()
    reference = Actor(recipe, 2, None)
    seen: set[str] = set()
    unwrap(actor.model).register_forward_pre_hook(
        lambda _m, args: seen.update(str(a.device) for a in args if isinstance(a, torch.Tensor)))
    batch = _batch(hf["vocab_size"])
    batch.old_logprobs = actor.compute_logprobs(batch, TEMPERATURE)
    batch.ref_logprobs = reference.compute_logprobs(batch, TEMPERATURE)
    out: dict[str, Any] = {
        "param_devices": _devices_of(actor.model), "reference_devices": _devices_of(reference.model),
        "logprobs_device": str(batch.old_logprobs.device), "logprob_max_abs_err_vs_fp64": _logprob_check(actor, batch)}
    if actor.quantization is not None:
        out["nf4_modules"] = len(actor.quantization.quantized)
        modules = dict(unwrap(actor.model).named_modules())
        out["nf4_holder_classes"] = sorted({type(modules[m]).__name__ for m in actor.quantization.quantized})
        # Read from the built modules, not from the switch that chose them (audit 5 #7).
        out["spec"] = "qlora-te" if any(type(m).__name__ == "TEDotProductAttention" for m in modules.values()) \
            else "qlora-local"
        out["te_expected"] = use_transformer_engine()
    before = _snapshot(actor.model)
    cfg = AlgorithmConfig(kl_beta=0.05)
    step = actor.train_step(batch, cfg, temperature=TEMPERATURE, rl_step=0)
    now = _snapshot(actor.model)
    changed = {n for n in now if not torch.equal(now[n], before[n])}
    moved = max(float((now[n] - before[n]).abs().max()) for n in now)
    if qlora:
        trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
        out["only_adapters_moved"] = bool(changed) and changed <= trainable
    after = _snapshot(actor.model)
    param = next(p for p in actor.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: torch.full_like(g, math.nan))
    poisoned = actor.train_step(batch, cfg, temperature=TEMPERATURE, rl_step=1)
    hook.remove()
    unchanged = all(torch.equal(now, after[n]) for n, now in _snapshot(actor.model).items())
    out.update(batch_devices=sorted(seen), loss=step["loss/total"], grad_norm=step["grad_norm"],
               update_skipped=step["update_skipped"], max_weight_change=moved,
               nan_guard={"loss": poisoned["loss/total"], "grad_norm": poisoned["grad_norm"],
                          "skipped": poisoned["update_skipped"], "weights_unchanged": unchanged},
               seconds=round(time.perf_counter() - started, 2))
    return out


def _failures(name: str, r: dict[str, Any], device: str) -> list[str]:
    if "skipped" in r:
        return []
    checks = {
        "every parameter on the device": r["param_devices"] == [device] and r["reference_devices"] == [device],
        "micro-batches on the device": r["batch_devices"] == [device],
        "log-probs returned on the CPU": r["logprobs_device"] == "cpu",
        f"log-probs within {LOGPROB_ATOL:g} of float64": r["logprob_max_abs_err_vs_fp64"] <= LOGPROB_ATOL,
        "GRPO step applied": r["update_skipped"] == 0.0 and math.isfinite(r["loss"]) and r["max_weight_change"] > 0,
        "NaN gradient under a finite loss skipped": (math.isfinite(r["nan_guard"]["loss"])
                                                      and r["nan_guard"]["skipped"] == 1.0
                                                      and r["nan_guard"]["weights_unchanged"]),
    }
    if "nf4_modules" in r or name.endswith("_qlora"):
        checks["an NF4 base"] = r.get("nf4_modules", 0) > 0
        checks["the NF4 base in local linears (the QLoRA spec)"] = \
            set(r.get("nf4_holder_classes", ["?"])) <= {"ColumnParallelLinear", "RowParallelLinear"}
        checks["a step moves the adapters only"] = r.get("only_adapters_moved") is True
        # With TE importable the spec must hold TE's norms and attention (audit 5 #7).
        checks["the QLoRA spec's TE pieces where TE is installed"] = \
            r.get("spec") == ("qlora-te" if r.get("te_expected") else "qlora-local")
    return [f"{name}: {what}" for what, ok in checks.items() if not ok]


def _plain(value: Any) -> Any:
    """Strict JSON: a non-finite float becomes its name ("nan", "inf")."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    _world_of_one()
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()          # a no-op on CUDA; megatron-core needs it on a CPU-only machine
    from megatron_rl.megatron.devices import compute_device, init_distributed

    init_distributed()
    device = str(compute_device())
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    report: dict[str, Any] = {"device": device, "torch": torch.__version__, "dtype": args.dtype,
                              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    failures: list[str] = []
    try:
        report["world"] = world_group()
        failures += _world_failures(report["world"], device)
    except Exception as exc:              # noqa: BLE001 - reported in the JSON line
        report["world"] = {"error": f"{type(exc).__name__}: {exc}"}
        failures.append(f"world group: {type(exc).__name__}")
    for name in args.models.split(","):
        try:
            report[name] = run_model(name, MODELS[name], dtype)
        except Exception as exc:          # reported in the JSON line, which is the script's output
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            failures.append(f"{name}: {type(exc).__name__}")
            continue
        failures += _failures(name, report[name], device)
    if torch.cuda.is_available():
        report["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    report["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    report["ok"], report["failures"] = not failures, failures
    print(json.dumps(_plain(report), allow_nan=False), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
