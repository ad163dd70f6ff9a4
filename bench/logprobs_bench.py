"""Peak extra memory and time: chunked ``vocab_parallel_logprobs`` vs the naive path.

Naive: ``log_softmax(logits).gather(target)`` plus entropy ``−Σ p·log p`` from the
same log-softmax. Both variants compute log-prob AND entropy; forward+backward
back-propagates ``Σ(w1·logp + w2·H)`` into the logits.

Each variant runs in a fresh subprocess; "peak extra" is the process's peak RSS
(``resource.getrusage().ru_maxrss``) minus the RSS right after the logits were
allocated. CPU allocations this large are ``mmap``-backed and returned on free, so
RSS follows live tensors. Usage:

    python bench/logprobs_bench.py [--tokens 4096] [--vocab 151936] [--chunk-size 0]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = ("chunked_fwd", "naive_fwd", "chunked_fwd_bwd", "naive_fwd_bwd")
# Rough peak of each variant in units of the logits' size, to skip what cannot fit.
_FOOTPRINT = {"chunked_fwd": 1.5, "naive_fwd": 4.0, "chunked_fwd_bwd": 2.5, "naive_fwd_bwd": 6.0}


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _naive(logits: Any, target: Any) -> tuple[Any, Any]:
    import torch

    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return logp, entropy


def _chunked(logits: Any, target: Any, chunk_size: int) -> tuple[Any, Any]:
    from megatron_rl.logprobs import vocab_parallel_logprobs

    out = vocab_parallel_logprobs(logits, target, chunk_size=chunk_size or None, use_te=False)
    return out.logprobs, out.entropy


def run_variant(variant: str, tokens: int, vocab: int, chunk_size: int) -> dict[str, float]:
    """Run one variant in this process and measure it (meant for a fresh subprocess)."""
    import torch

    import megatron_rl.logprobs  # noqa: F401  (imported before the baseline is taken)

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    backward = variant.endswith("fwd_bwd")
    logits = torch.randn(tokens, vocab, dtype=torch.float32, requires_grad=backward)
    target = torch.randint(0, vocab, (tokens,))
    w1, w2 = torch.randn(tokens), torch.randn(tokens)
    baseline = _rss_peak_bytes()
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        if variant.startswith("naive"):
            logp, entropy = _naive(logits, target)
        else:
            logp, entropy = _chunked(logits, target, chunk_size)
        if backward:
            (logp * w1 + entropy * w2).sum().backward()
    seconds = time.perf_counter() - start
    return {"peak_extra_bytes": _rss_peak_bytes() - baseline, "seconds": seconds}


def _spawn(variant: str, args: argparse.Namespace) -> dict[str, float | str]:
    import psutil

    need = _FOOTPRINT[variant] * args.tokens * args.vocab * 4
    if psutil.virtual_memory().available < need * 1.2:
        return {"skipped": f"needs ~{need / 2**30:.1f} GiB, not available"}
    cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--chunk-size", str(args.chunk_size)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        return {"failed": done.stderr.strip()[-500:] or f"exit code {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk-size", type=int, default=0, help="0 = library default")
    parser.add_argument("--child", choices=VARIANTS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child, args.tokens, args.vocab, args.chunk_size)))
        return
    results = {v: _spawn(v, args) for v in VARIANTS}
    report: dict[str, object] = {
        "tokens": args.tokens, "vocab": args.vocab, "chunk_size": args.chunk_size,
        "logits_bytes": args.tokens * args.vocab * 4, "variants": results,
    }
    for mode in ("fwd", "fwd_bwd"):
        ours, naive = results[f"chunked_{mode}"], results[f"naive_{mode}"]
        if "peak_extra_bytes" in ours and "peak_extra_bytes" in naive:
            report[f"memory_ratio_{mode}"] = ours["peak_extra_bytes"] / naive["peak_extra_bytes"]
            report[f"time_ratio_{mode}"] = ours["seconds"] / naive["seconds"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
