"""Benchmark `megatron-rl convert` both ways on a ~1.4 GB random Qwen3-MoE checkpoint (bf16).

    .venv/bin/python bench/convert_bench.py [--dir /tmp/convert_bench] [--tp 2 --ep 4 --etp 1]
                                            [--cache cold|warm]

Prints one JSON object:
- read: plain sequential read of every HF shard, twice: from the disk (the files evicted from the
  page cache first with posix_fadvise(DONTNEED), which needs no privileges) and from the page
  cache (read once beforehand); write: the same number of bytes written sequentially with fsync
  (the output side's bound on this disk);
- hf_to_mcore / mcore_to_hf: wall time of the whole CLI (process start, imports, conversion,
  writes with fsync) and the workers' own time; throughput = HF bytes / time. With --cache cold
  (default) each conversion's input files are evicted first, so it reads from the disk like the
  plain disk read; warm leaves them cached;
- memory: RSS sampled every 20 ms over the whole process tree (CLI, torchrun, workers, helpers):
  the largest single process and the largest instantaneous sum; plus each worker's exact peak
  (ru_maxrss) as the workers report it. Targets: throughput ≥ 50 % of the read throughput;
  peak RSS per process ≤ 2 × the largest HF shard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl.weights.hf_io import HFCheckpointReader, HFCheckpointWriter  # noqa: E402

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16",
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512,
    "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
    "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
MAX_SHARD = 500 * 10**6


def hf_shapes(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3-MoE tensor names and shapes, in the order HF checkpoints store layers."""
    h, hd, q, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                (f"{p}.self_attn.q_proj.weight", (q * hd, h)), (f"{p}.self_attn.k_proj.weight", (kv * hd, h)),
                (f"{p}.self_attn.v_proj.weight", (kv * hd, h)), (f"{p}.self_attn.o_proj.weight", (h, q * hd)),
                (f"{p}.self_attn.q_norm.weight", (hd,)), (f"{p}.self_attn.k_norm.weight", (hd,)),
                (f"{p}.mlp.gate.weight", (c["num_experts"], h))]
        for e in range(c["num_experts"]):
            f = c["moe_intermediate_size"]
            out += [(f"{p}.mlp.experts.{e}.gate_proj.weight", (f, h)), (f"{p}.mlp.experts.{e}.up_proj.weight", (f, h)),
                    (f"{p}.mlp.experts.{e}.down_proj.weight", (h, f))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]


def build_checkpoint(out: Path) -> Path:
    stamp = json.dumps({"config": CONFIG, "max_shard": MAX_SHARD}, sort_keys=True)
    if (out / ".bench-stamp").is_file() and (out / ".bench-stamp").read_text() == stamp:
        return out
    g = torch.Generator().manual_seed(0)
    writer = HFCheckpointWriter(out, max_shard_bytes=MAX_SHARD)
    for name, shape in hf_shapes(CONFIG):
        writer.add(name, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))
    writer.finish(config=CONFIG)
    (out / ".bench-stamp").write_text(stamp)
    return out


def read_throughput(files: list[Path]) -> float:
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    total, start = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total / (time.perf_counter() - start)


def evict(paths: list[Path]) -> None:
    """Drop the files' clean pages from the page cache, so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def write_throughput(path: Path, nbytes: int) -> float:
    """Plain sequential write of `nbytes` with fsync: what the disk gives the output side."""
    buf = memoryview(bytearray(64 << 20))
    start, left = time.perf_counter(), nbytes
    with open(path, "wb", buffering=0) as f:
        while left > 0:
            left -= f.write(buf[: min(left, len(buf))])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return nbytes / seconds


def _kind(proc: psutil.Process, root: psutil.Process) -> str:
    """By place in the tree, not by command line (a process just forked, or exiting, shows another
    one or none): the CLI, torchrun (its child), the workers (torchrun's children) and the helpers
    megatron spawns (the workers' children)."""
    depth, p = 0, proc
    while p is not None and p.pid != root.pid and depth < 4:
        p, depth = p.parent(), depth + 1
    return {0: "cli", 1: "torchrun", 2: "worker"}.get(depth, "helper")


class TreeMonitor:
    """Peak RSS of every process under `pid` (sampled), and the peak of their sum."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.root, self.interval = psutil.Process(pid), interval
        self.per_process: dict[int, tuple[str, int]] = {}
        self.peak_sum = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    label = self.per_process[p.pid][0] if p.pid in self.per_process else _kind(p, self.root)
                except psutil.Error:
                    continue
                total += rss
                self.per_process[p.pid] = (label, max(self.per_process.get(p.pid, (label, 0))[1], rss))
            self.peak_sum = max(self.peak_sum, total)
            time.sleep(self.interval)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        by_label: dict[str, int] = {}
        for label, rss in self.per_process.values():
            by_label[label] = max(by_label.get(label, 0), rss)
        return {"peak_rss_max_process": max(r for _, r in self.per_process.values()),
                "peak_rss_max_by_kind": by_label, "peak_rss_sum": self.peak_sum, "processes": len(self.per_process)}


def convert(args: list[str], stats: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "megatron_rl.cli", "convert", *args, "--no-progress", "--force",
           "--stats-json", str(stats)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    monitor = TreeMonitor(proc.pid)
    _, err = proc.communicate()
    wall = time.perf_counter() - start
    memory = monitor.stop()
    if proc.returncode != 0:
        raise SystemExit(f"conversion failed:\n{err}")
    return {"wall_s": wall, "workers": json.loads(stats.read_text()), **memory}


def summarize(run: dict[str, Any], nbytes: int, read_bps: dict[str, float], largest_shard: int,
              write_bps: float) -> dict[str, Any]:
    w = run["workers"]
    inner = w.get("load_seconds", 0) + w.get("save_seconds", 0) + w.get("write_seconds", 0)
    rates = {"wall": nbytes / run["wall_s"], "workers": nbytes / w["seconds"]}
    return {
        "wall_s": round(run["wall_s"], 2), "worker_s": round(w["seconds"], 2),
        "phases_s": {k: round(v, 2) for k, v in w.items() if k.endswith("_seconds")},
        **{f"throughput_{k}_Bps": round(v) for k, v in rates.items()},
        **{f"throughput_{k}_vs_read_{cache}": round(v / bps, 4)
           for k, v in rates.items() for cache, bps in read_bps.items()},
        "conversion_phases_s": round(inner, 2),
        "throughput_workers_vs_fsync_write": round(rates["workers"] / write_bps, 4),
        "peak_rss_max_process": run["peak_rss_max_process"], "peak_rss_max_by_kind": run["peak_rss_max_by_kind"],
        "peak_rss_sum": run["peak_rss_sum"], "peak_rss_per_worker_rusage": w["peak_rss_per_rank"],
        "peak_rss_max_process_vs_largest_shard": round(run["peak_rss_max_process"] / largest_shard, 3),
        "world_size": w["world_size"],
    }


def bit_identical(a: Path, b: Path) -> bool:
    ra, rb = HFCheckpointReader(a), HFCheckpointReader(b)
    if sorted(ra.names()) != sorted(rb.names()):
        return False
    return all(ra.get(n).dtype == rb.get(n).dtype and torch.equal(ra.get(n), rb.get(n)) for n in ra.names())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/convert_bench")
    ap.add_argument("--tp", default="2")
    ap.add_argument("--ep", default="4")
    ap.add_argument("--etp", default="1")
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold",
                    help="evict each conversion's input from the page cache first (cold) or not")
    args = ap.parse_args()
    root = Path(args.dir)
    hf = build_checkpoint(root / "hf")
    files = HFCheckpointReader(hf).shard_files()
    nbytes = sum(f.stat().st_size for f in files)
    largest = max(f.stat().st_size for f in files)
    evict(files)
    read_bps = {"disk": read_throughput(files)}
    read_bps["page_cache"] = read_throughput(files)     # cached by the read just before
    write_bps = write_throughput(root / "write_test.bin", nbytes)
    layout = ["--tp", args.tp, "--ep", args.ep, "--etp", args.etp]
    if args.cache == "cold":
        evict(files)
    to_mcore = convert(["hf-to-mcore", "--hf", str(hf), "--out", str(root / "mcore"), *layout], root / "s1.json")
    if args.cache == "cold":
        evict(files_under(root / "mcore"))
    to_hf = convert(["mcore-to-hf", "--mcore", str(root / "mcore"), "--out", str(root / "hf_back"),
                     "--max-shard-size", str(MAX_SHARD), *layout], root / "s2.json")
    result = {
        "model": {"architecture": "Qwen3MoeForCausalLM", "dtype": "bfloat16", "hf_bytes": nbytes, "shards": len(files),
                  "largest_shard_bytes": largest, "layers": CONFIG["num_hidden_layers"],
                  "experts": CONFIG["num_experts"], "layout": f"TP{args.tp} EP{args.ep} ETP{args.etp}"},
        "read_Bps_disk": round(read_bps["disk"]), "read_Bps_page_cache": round(read_bps["page_cache"]),
        "conversion_inputs": args.cache,
        "write_Bps_fsync": round(write_bps),
        "hf_to_mcore": summarize(to_mcore, nbytes, read_bps, largest, write_bps),
        "mcore_to_hf": summarize(to_hf, nbytes, read_bps, largest, write_bps),
        "round_trip_bit_identical": bit_identical(hf, root / "hf_back"),
        "cpu_cores": os.cpu_count(), "load_average_1m_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
