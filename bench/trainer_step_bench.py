"""Trainer step on a length mix: fixed padded micro-batches vs token-budget micro-batches.

One optimizer step of the real Megatron actor (GRPO, old log-probs pass + forward/backward +
Adam) on a batch where 80 % of the responses are shorter than 10 % of the token budget and the
rest reach up to the maximum length. The padded path cuts the rows into micro-batches of
`--micro-batch-size` rows of the full `prompt + response` width; the budget path groups rows by
length into micro-batches of at most `micro_batch_size × seq_len` tokens (the same planned peak),
each cut to its longest row.

Each variant runs in a fresh process (one rank, gloo on CPU or NCCL on a GPU): peak memory is the
GPU's peak allocation, or on CPU the process's peak RSS above the RSS after the model was built.
Both variants see the same batch and weights, so their losses must agree; the report gives both,
and the ratios budget / padded. Usage:

    python bench/trainer_step_bench.py [--rows 32] [--max-prompt 128] [--max-response 384] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import emit  # noqa: E402

VARIANTS = ("padded", "budget")
MODEL = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=8192, hidden_size=256,
             intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
             max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def length_mix(rows: int, max_prompt: int, max_response: int, budget: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths: 80 % of responses under 10 % of the budget, 20 % up to the max."""
    import random

    rng = random.Random(seed)
    short = max(2, min(max_response, budget // 10))
    out = []
    for i in range(rows):
        response = rng.randint(1, short - 1) if i % 5 else rng.randint(short, max_response)
        out.append((rng.randint(max_prompt // 4, max_prompt), response))
    rng.shuffle(out)
    return out


def make_batch(lengths: list[tuple[int, int]], seq_len: int, vocab: int, seed: int):  # noqa: ANN201
    import torch

    from megatron_rl.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    tokens = torch.zeros(n, seq_len, dtype=torch.long)
    mask = torch.zeros(n, seq_len - 1)
    for i, (prompt, response) in enumerate(lengths):
        tokens[i, :prompt + response] = torch.randint(1, vocab, (prompt + response,), generator=g)
        mask[i, prompt - 1:prompt + response - 1] = 1.0
    return TrainBatch(tokens=tokens, mask=mask, advantages=torch.randn(n, generator=g))


def _peak_bytes(torch) -> int:  # noqa: ANN001
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # Linux reports KiB


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, float]:
    """One warm-up step, then `args.steps` timed steps of this variant (meant for a fresh process)."""
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()
    from megatron_rl.config.schema import AlgorithmConfig, ParallelismConfig, TrainerConfig
    from megatron_rl.megatron.actor import Actor, Training, init_parallel
    from megatron_rl.models import build_model

    seq_len = args.max_prompt + args.max_response
    budget = args.micro_batch_size * seq_len
    init_parallel(ParallelismConfig(), seed=1)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    actor = Actor(build_model(dict(MODEL), ParallelismConfig(), dtype), args.micro_batch_size,
                  Training(TrainerConfig(lr=1e-5), ParallelismConfig(), total_updates=100),
                  max_tokens_per_microbatch=budget if variant == "budget" else None)
    batch = make_batch(length_mix(args.rows, args.max_prompt, args.max_response, budget, args.seed), seq_len,
                       MODEL["vocab_size"], args.seed)
    cfg = AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = 0 if torch.cuda.is_available() else _peak_bytes(torch)
    times, losses = [], []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        batch.old_logprobs = actor.compute_logprobs(batch, temperature=1.0)
        metrics = actor.train_step(batch, cfg, temperature=1.0, rl_step=step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(metrics["loss/total"])
    mbs = actor._local_microbatches(batch)
    return {"step_s": min(times[1:]), "step_s_all": times, "peak_bytes": _peak_bytes(torch) - baseline,
            "peak_total_bytes": _peak_bytes(torch),
            "losses": losses, "microbatches": len(mbs),
            "tokens_computed": sum(mb.tokens.numel() for mb in mbs)}


def _spawn(variant: str, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("child", "json_out")]
    cmd = [sys.executable, __file__, "--child", variant, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        return {"failed": done.stderr.strip()[-800:] or f"exit code {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--max-response", type=int, default=384)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="padded path; budget = this × seq_len")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=VARIANTS)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child, args)))
        return
    started = time.perf_counter()
    seq_len = args.max_prompt + args.max_response
    lengths = length_mix(args.rows, args.max_prompt, args.max_response, args.micro_batch_size * seq_len, args.seed)
    results = {v: _spawn(v, args) for v in VARIANTS}
    out: dict = {"rows": args.rows, "seq_len": seq_len, "token_budget": args.micro_batch_size * seq_len,
                 "padded_micro_batch_size": args.micro_batch_size,
                 "real_tokens": sum(p + r for p, r in lengths), "padded_tokens": args.rows * seq_len,
                 "device": "cuda" if _cuda() else "cpu", "variants": results}
    padded, budget = results["padded"], results["budget"]
    if "step_s" in padded and "step_s" in budget:
        out["step_time_ratio"] = budget["step_s"] / padded["step_s"]
        out["peak_memory_ratio"] = budget["peak_bytes"] / padded["peak_bytes"]
        out["max_loss_rel_diff"] = max(abs(a - b) / max(abs(a), 1e-12)
                                       for a, b in zip(padded["losses"], budget["losses"]))
    emit(out, started, args.json_out)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
