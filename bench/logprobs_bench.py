"""Peak extra memory and time: chunked ``vocab_parallel_logprobs`` vs the naive path (and, with
``--fused``, the fused LM head vs both, from the hidden states).

Naive: ``log_softmax(logits).gather(target)`` plus entropy ``−Σ p·log p`` from the
same log-softmax. Both variants compute log-prob AND entropy; forward+backward
back-propagates ``Σ(w1·logp + w2·H)`` into the logits.

Each variant runs in a fresh subprocess; "peak extra" is the process's peak RSS
(``resource.getrusage().ru_maxrss``) minus the RSS right after the logits were
allocated. CPU allocations this large are ``mmap``-backed and returned on free, so
RSS follows live tensors. Usage:

    python bench/logprobs_bench.py [--tokens 4096] [--vocab 151936] [--chunk-size 0]

A variant that cannot fit in the available memory is skipped with its estimated peak extra
(``_FOOTPRINT`` × the logits' bytes, plus autograd's weight gradient under ``--fused``), marked
``"estimated": true``; the fused head's memory ratio to it is then given against that estimate.
``--tokens-list 4096,32768`` runs several rows; ``--variants fused`` (or ``fused_fwd_bwd``, ...)
runs a subset; ``--time-limit S`` stops a variant after S seconds (reported as timed out).
``--device cuda --dtype bf16`` (with ``--fused``) runs the variants on a GPU in the model's dtype, the
peak taken from the CUDA caching allocator after a warm-up run (torch only, no vLLM or megatron-core):
where GEMMs are fast, the passes over the logits weigh more in the ratio than on a CPU.

``--fused [--hidden 4096]``: every variant starts from hidden states ``[tokens, hidden]`` and an
output weight ``[vocab, hidden]``: naive and chunked compute the logits with the output layer's GEMM
first, the fused head (`fused_head.py`) never does. The weight has a preallocated float32
``main_grad`` (DDP's gradient buffer, part of the baseline): naive and chunked add autograd's weight
gradient into it from a post-accumulate hook (DDP's), the fused head accumulates into it directly
(megatron's gradient-accumulation fusion). On the CPU the fused head's placeholder gradient is never
touched, so RSS does not count it; on a GPU it is one weight-sized allocation (megatron's own
non-TE path allocates the same).
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

from _report import emit  # noqa: E402  (bench/, the script's own directory)

VARIANTS = ("chunked_fwd", "naive_fwd", "chunked_fwd_bwd", "naive_fwd_bwd")
HEAD_VARIANTS = tuple(f"head_{v}_{m}" for m in ("fwd", "fwd_bwd") for v in ("naive", "chunked", "fused"))
# Rough peak of each variant in units of the logits' size, to skip what cannot fit.
_FOOTPRINT = {"chunked_fwd": 1.5, "naive_fwd": 4.0, "chunked_fwd_bwd": 2.5, "naive_fwd_bwd": 6.0,
              "head_chunked_fwd": 1.5, "head_naive_fwd": 4.0, "head_fused_fwd": 0.0,
              "head_chunked_fwd_bwd": 2.5, "head_naive_fwd_bwd": 6.0, "head_fused_fwd_bwd": 0.0}


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


def _ddp_hook(weight: Any) -> None:
    """DDP's post-accumulate hook: the gradient into `main_grad` unless already there, then freed."""
    if not weight.grad_added_to_main_grad:
        weight.main_grad.add_(weight.grad)
    weight.grad = None


def run_head_variant(variant: str, tokens: int, vocab: int, hidden: int, chunk_size: int,
                     device: str = "cpu", dtype: str = "fp32") -> dict[str, float]:
    """One `--fused` variant, from hidden states and an output weight (meant for a fresh subprocess).
    On CUDA: the operands in `dtype` (main_grad float32, as megatron keeps it), one untimed warm-up
    run (cuBLAS handles, kernels), then the measured run; peak extra = the caching allocator's peak
    minus what was allocated before it (`torch.cuda.max_memory_allocated`), time synchronized."""
    import torch

    from megatron_rl.fused_head import fused_head_logprobs

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    dev, dt = torch.device(device), {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    backward = variant.endswith("fwd_bwd")
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen).to(dev, dt).requires_grad_(backward)
    w = torch.nn.Parameter(torch.randn(vocab, hidden, generator=gen).mul_(3 / hidden ** 0.5).to(dev, dt),
                           requires_grad=backward)
    if backward:
        w.main_grad = torch.zeros(vocab, hidden, device=dev)  # type: ignore[attr-defined]
        w.grad_added_to_main_grad = False                     # type: ignore[attr-defined]
        w.register_post_accumulate_grad_hook(_ddp_hook)
    target = torch.randint(0, vocab, (tokens,), generator=gen).to(dev)
    w1, w2 = torch.randn(tokens, generator=gen).to(dev), torch.randn(tokens, generator=gen).to(dev)

    def once() -> None:
        with torch.set_grad_enabled(backward):
            if "fused" in variant:
                out = fused_head_logprobs(h, w, target, chunk_size=chunk_size or None, into_main_grad=True)
                logp, entropy = out.logprobs, out.entropy
            elif "naive" in variant:
                logp, entropy = _naive((h @ w.t()).float(), target)    # megatron's unfused path upcasts
            else:
                logp, entropy = _chunked(h @ w.t(), target, chunk_size)
            if backward:
                (logp * w1 + entropy * w2).sum().backward()
                h.grad = None

    if dev.type == "cuda":
        once()
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        baseline = torch.cuda.memory_allocated(dev)
        start = time.perf_counter()
        once()
        torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - start
        return {"peak_extra_bytes": torch.cuda.max_memory_allocated(dev) - baseline, "seconds": seconds}
    baseline = _rss_peak_bytes()
    start = time.perf_counter()
    once()
    seconds = time.perf_counter() - start
    return {"peak_extra_bytes": _rss_peak_bytes() - baseline, "seconds": seconds}


def _available_bytes(device: str) -> int:
    """What a variant may use: free host memory, or the GPU's free memory (asked in a subprocess,
    so that this process holds no CUDA context while the variants run)."""
    if device == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    probe = f"import torch; print(torch.cuda.mem_get_info(torch.device({device!r}))[0])"
    return int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)


def _spawn(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    extra = _FOOTPRINT[variant] * args.tokens * args.vocab * 4
    if variant.endswith("fwd_bwd") and variant.startswith("head_") and "fused" not in variant:
        extra += args.vocab * args.hidden * 4      # autograd's weight gradient, before DDP's hook frees it
    need = extra
    if variant.startswith("head_"):     # weight, main_grad, a weight gradient, chunk temporaries
        need += 3 * args.vocab * args.hidden * 4 + 2**30
    if args.available < need * 1.2:
        return {"skipped": f"needs ~{need / 2**30:.1f} GiB, not available",
                "estimated_peak_extra_bytes": int(extra), "estimated": True}
    if variant.removeprefix("head_") not in args.variants:
        return {"not_run": "not in --variants"}
    cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--chunk-size", str(args.chunk_size), "--hidden", str(args.hidden),
           "--device", args.device, "--dtype", args.dtype]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                              timeout=args.time_limit or None)
    except subprocess.TimeoutExpired:
        return {"timed_out_after_s": args.time_limit}
    if done.returncode != 0:
        return {"failed": done.stderr.strip()[-500:] or f"exit code {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _variant_names(spec: str) -> set[str]:
    """``--variants``: full names (``fused_fwd_bwd``) or a path for both modes (``fused``)."""
    known = {v.removeprefix("head_") for v in VARIANTS + HEAD_VARIANTS}
    names: set[str] = set()
    for item in filter(None, (x.strip() for x in spec.split(","))):
        expanded = {f"{item}_fwd", f"{item}_fwd_bwd"} if item in ("naive", "chunked", "fused") else {item}
        if not expanded <= known:
            raise SystemExit(f"--variants: unknown {item!r}; allowed: naive, chunked, fused or one of {sorted(known)}")
        names |= expanded
    return names or known


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk-size", type=int, default=0, help="0 = library default")
    parser.add_argument("--fused", action="store_true", help="from hidden states: naive, chunked and fused head")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (--fused)")
    parser.add_argument("--tokens-list", type=str, default="", help="--fused: comma-separated token counts")
    parser.add_argument("--variants", type=str, default="",
                        help="comma-separated subset: naive, chunked, fused (both modes) or e.g. fused_fwd_bwd")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="seconds per variant (0 = none); a variant past it is reported as timed out")
    parser.add_argument("--device", default="cpu", help="--fused: cpu, or cuda[:N] (peak from the CUDA allocator)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="--fused: the hidden states' and weight's dtype (main_grad is float32)")
    parser.add_argument("--child", choices=VARIANTS + HEAD_VARIANTS)
    args = parser.parse_args()
    args.variants = _variant_names(args.variants)
    if args.device != "cpu" and not args.fused:
        raise SystemExit("--device: only --fused runs on a GPU (the logits-only comparison is a CPU one)")
    if args.child:
        run = run_head_variant(args.child, args.tokens, args.vocab, args.hidden, args.chunk_size, args.device,
                               args.dtype) \
            if args.child.startswith("head_") else run_variant(args.child, args.tokens, args.vocab, args.chunk_size)
        print(json.dumps(run))
        return
    if args.fused:
        started = time.perf_counter()
        rows = [int(t) for t in args.tokens_list.split(",")] if args.tokens_list else [args.tokens]
        args.available = _available_bytes(args.device)
        emit({"vocab": args.vocab, "hidden": args.hidden, "chunk_size": args.chunk_size,
              "device": args.device, "dtype": args.dtype,
              "threads": int(os.environ.get("BENCH_THREADS", "1")), "loadavg_start": os.getloadavg(),
              "rows": [_fused_row(argparse.Namespace(**{**vars(args), "tokens": t})) for t in rows]},
             started, None)
        return
    args.variants |= set(VARIANTS)   # the logits-only comparison always runs all four
    args.available = _available_bytes("cpu")
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


def _fused_row(args: argparse.Namespace) -> dict[str, Any]:
    """One token count of `--fused`: every variant, and the fused head's ratios to the others."""
    results = {v.removeprefix("head_"): _spawn(v, args) for v in HEAD_VARIANTS}
    row: dict[str, Any] = {"tokens": args.tokens, "logits_bytes": args.tokens * args.vocab * 4, "variants": results}
    for mode in ("fwd", "fwd_bwd"):
        fused = results[f"fused_{mode}"]
        for other in ("naive", "chunked"):
            base = results[f"{other}_{mode}"]
            if "peak_extra_bytes" not in fused:
                continue
            if "peak_extra_bytes" in base:
                row[f"fused_vs_{other}_{mode}"] = {"memory": fused["peak_extra_bytes"] / base["peak_extra_bytes"],
                                                   "time": fused["seconds"] / base["seconds"]}
            elif "estimated_peak_extra_bytes" in base:   # skipped for memory: against its estimated peak
                row[f"fused_vs_{other}_{mode}"] = {
                    "memory": fused["peak_extra_bytes"] / base["estimated_peak_extra_bytes"], "estimated": True}
    return row


if __name__ == "__main__":
    main()
