"""Benchmark a full weight sync (Megatron actor → rollout server) through the CPU shared-memory transport.

    .venv/bin/python bench/sync_bench.py [--dir /tmp/sync_bench] [--repeats 4] [--bucket-mb 512]
                                         [--models tiny,large] [--moe-load in_place|layerwise] [--json-out FILE]
    .venv/bin/python bench/sync_bench.py --delta [--repeats 5]      # delta vs dense (`bench_delta`)

What training runs use: the `mrl_shm` engine driven through vLLM's weight-transfer routes
(start/update/finish), loading through vLLM's layer-wise reload. The headline, printed to stderr and under `summary`:
the steady sync time (median after the first), the warm memcpy of the same bytes measured right
after each sync, and their ratio (memcpy_warm_s / sync_s; issue 17's target: ≥ 0.25).

What is measured, per model ("tiny" = the tiny MoE of recipes/tiny, "large" = a random fp32
Qwen3-MoE of ~491 MB built locally, exact size in the output):
- One trainer process (world 1, gloo, `init_process_group()` + `init_parallel`), an `Actor` without
  optimizer loaded from the HF checkpoint, and a real rollout server (vLLM, fp32, eager) on
  127.0.0.1 started from the same checkpoint.
- `sync_weights(...)` through one `SharedSegmentTransport` is run `--repeats` times (version 1, 2, ...):
  the first sync creates the shared-memory segments (and pays for their fresh pages on both
  sides), later ones rewrite them in place, as every sync of a training run after the first does.
  The first run and the median of the later ones are reported apart, with every run. The
  transport and its control endpoint are wrapped with timers, which splits each sync into:
    gather       gather + HF-name conversion on the trainer (total − begin − send − finish);
    write        the copy into the segments (send_bucket; the server is still serving then);
    pause        /pause (in finish, once everything is written);
    reload       /start_weight_update + /update_weights + /finish_weight_update + the workers'
                 `mrl_check_loaded` check: the server maps the segments, runs vLLM's layer-wise reload
                 from views into them and re-packs the CPU MoE experts;
    reset/resume /reset_prefix_cache + /resume.
  trainer_s = gather + write; server_s = reload (+ the control round trips, listed apart).
  Also this process's CPU time and minor page faults per phase: on a shared 2-core machine a
  phase whose CPU time is far below its wall time was waiting for a core, and a phase with ~n/4096
  faults for n bytes paid for touching fresh memory.
- Baselines on the same bytes (the actor's parameters, whose byte count equals what the sync
  sends): same-process memcpy (`torch.empty_like(t).copy_(t)` over every tensor; "memcpy" frees
  each copy at once, so the allocator may hand the same, already mapped block back;
  "memcpy_retained" keeps all copies, so every page is fresh; "memcpy_warm" copies into
  destinations allocated and touched beforehand: the memory bandwidth itself), a raw write of every tensor to
  one file in /dev/shm + read back into fresh tensors (the fair bound for a file transport), and
  a safetensors save_file + safe_open round trip through /dev/shm (the format's own cost; the
  read clones each tensor, since safe_open maps the file and touches nothing). Minor page
  faults are recorded for each.
- Each sync is followed at once by one round of the baselines (memory bandwidth on a shared VM
  swings by >10x within seconds); ratios_paired_median = median over repeats of (sync MB/s ÷
  baseline MB/s of the same round), ratios_of_medians = median sync MB/s ÷ median baseline MB/s.
  Issue target: ≥ 0.5 of memcpy (which memcpy is not said: all three are reported).
MB = 10^6 bytes. The machine is shared: the load average is recorded before and after each model.
Prints one JSON object (also written to --json-out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl.config.schema import ParallelismConfig  # noqa: E402
from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # before anything imports megatron-core
from _report import emit  # noqa: E402  (bench/, the script's own directory)

from megatron_rl.config.schema import RolloutConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, init_parallel, unwrap  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.rollout.engines import MOE_LOAD, MOE_LOADS  # noqa: E402
from megatron_rl.rollout.server import RolloutServer  # noqa: E402
from megatron_rl.sync import sync_weights  # noqa: E402
from megatron_rl.sync.shm import SharedSegmentTransport  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402

# ~491 MB fp32 Qwen3-MoE (all dims multiples of 32, head_dim 64). Exact count, see hf_param_count:
# per layer q 1024·1024 + k,v 2·256·1024 + o 1024·1024 + q/k-norm 2·64 + 2 layer norms 2·1024
# + router 8·1024 + experts 8·3·512·1024 = 15,214,720; × 8 layers = 121,717,760; + embed and
# lm_head 2·512·1024 + final norm 1024 = 122,767,360 parameters = 491,069,440 bytes.
# (8 experts × moe_intermediate 1024 would be ~0.89 GB, hence 512.) vocab 512 = the demo tokenizer.
LARGE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
    "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 512,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


DELTA = {**LARGE, "num_hidden_layers": 14}
"""--delta: the same Qwen3-MoE with 14 layers, in bf16: 214,021,120 parameters = 428 MB."""


def hf_param_count(c: dict[str, Any]) -> int:
    """Parameters of a Qwen3-MoE config with every layer sparse (decoder_sparse_step 1)."""
    h, hd, q, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    e, f = c["num_experts"], c["moe_intermediate_size"]
    layer = 2 * q * hd * h + 2 * kv * hd * h + 2 * hd + 2 * h + e * h + 3 * e * f * h
    return c["num_hidden_layers"] * layer + 2 * c["vocab_size"] * h + h


class TimedEndpoint:
    """The server's control endpoint with every post/rpc timed by path or method."""

    def __init__(self, server: Any, times: dict[str, float]) -> None:
        self.server, self.times = server, times

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)          # restarts, base_url, token

    def post(self, path: str, body: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
             timeout: float = 600.0) -> Any:
        t = time.perf_counter()
        try:
            return self.server.post(path, body, params, timeout)
        finally:
            self.times[f"post {path}"] += time.perf_counter() - t

    def rpc(self, method: str, *args: str, timeout: float = 600.0) -> list[Any]:
        t = time.perf_counter()
        try:
            return self.server.rpc(method, *args, timeout=timeout)
        finally:
            self.times[f"rpc {method}"] += time.perf_counter() - t


class TimedTransport:
    """A transport with begin/send_bucket/finish/abort timed (wall, this process's CPU time, and
    its minor page faults, to tell page-fault and CPU-starvation costs on a shared machine apart)."""

    def __init__(self, inner: SharedSegmentTransport, times: dict[str, float]) -> None:
        self.inner, self.times = inner, times

    def _timed(self, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        before = _snapshot()
        try:
            return fn(*args)
        finally:
            for suffix, delta in zip(("", "_cpu", "_faults"), _delta(before)):
                self.times[key + suffix] += delta

    def begin(self, version: int) -> None:
        self._timed("begin", self.inner.begin, version)

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        self._timed("send_bucket", self.inner.send_bucket, tensors)

    def finish(self, names: list[str]) -> dict[str, Any]:
        return self._timed("finish", self.inner.finish, names)

    def abort(self) -> None:
        self._timed("abort", self.inner.abort)


def _snapshot() -> tuple[float, float, int]:
    return time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _delta(before: tuple[float, float, int]) -> tuple[float, float, int]:
    now = _snapshot()
    return now[0] - before[0], now[1] - before[1], now[2] - before[2]


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def one_sync(actor: Any, adapter: Any, inner: SharedSegmentTransport, times: dict[str, float],
             version: int) -> dict[str, Any]:
    times.clear()
    transport = TimedTransport(inner, times)
    before = _snapshot()
    report = sync_weights(actor.model, adapter, transport, version, torch.float32)
    wall, cpu, faults = _delta(before)
    assert report is not None
    write = times["send_bucket"]
    gather = wall - times["begin"] - times["send_bucket"] - times["finish"]     # begin: no server call
    reload = sum(times[f"post /{r}"] for r in ENGINE_ROUTES) + times["rpc mrl_check_loaded"]
    calls = ("begin", "send_bucket", "finish")
    return {
        "version": version, "bytes": report.bytes, "tensors": report.tensors, "parts": report.parts,
        "segments": len(inner.layout.sizes),
        "total_s": wall, "mb_per_s": report.bytes / 1e6 / wall,
        "pause_s": times["post /pause"],
        "gather_convert_s": gather, "write_segments_s": write,
        "server_reload_s": reload, "reset_prefix_cache_s": times["post /reset_prefix_cache"],
        "resume_s": times["post /resume"],
        "trainer_s": gather + write, "server_s": reload,
        "control_rpcs_s": wall - gather - write - reload,
        "trainer_cpu_s": cpu, "gather_convert_cpu_s": cpu - sum(times[c + "_cpu"] for c in calls),
        "write_segments_cpu_s": times["send_bucket_cpu"],
        "minor_faults": faults, "gather_convert_minor_faults": faults - sum(times[c + "_faults"] for c in calls),
        "write_segments_minor_faults": times["send_bucket_faults"],
        "server_result": report.server,
    }


ENGINE_ROUTES = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


def memcpy_s(tensors: list[torch.Tensor]) -> float:
    t = time.perf_counter()
    for x in tensors:
        torch.empty_like(x).copy_(x)
    return time.perf_counter() - t


def memcpy_retained_s(tensors: list[torch.Tensor]) -> float:
    """The same copies, but every destination kept until the end: the copy really lands in fresh
    memory (page faults included), as the sync's buckets do. The plain variant above frees each
    destination at once, so the allocator may hand the same mapped block back for the next one."""
    t = time.perf_counter()
    out = [torch.empty_like(x).copy_(x) for x in tensors]
    elapsed = time.perf_counter() - t
    del out
    return elapsed


def memcpy_warm_s(tensors: list[torch.Tensor], dest: list[torch.Tensor]) -> float:
    """Copies into destinations that exist and were written before: no allocation, no page fault."""
    t = time.perf_counter()
    for d, x in zip(dest, tensors):
        d.copy_(x)
    return time.perf_counter() - t


def shm_roundtrip_s(tensors: list[torch.Tensor], directory: Path) -> tuple[float, float]:
    """Raw bytes of every tensor into one /dev/shm file, then read back into fresh tensors."""
    path = directory / "raw.bin"
    t = time.perf_counter()
    with open(path, "wb") as f:
        for x in tensors:
            f.write(memoryview(x.contiguous().numpy()).cast("B"))
    write = time.perf_counter() - t
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for x in tensors:
            out = torch.empty_like(x)
            view = memoryview(out.numpy()).cast("B")
            got = 0
            while got < len(view):
                got += f.readinto(view[got:])
    read = time.perf_counter() - t
    path.unlink()
    return write, read


def safetensors_roundtrip_s(tensors: list[torch.Tensor], directory: Path) -> tuple[float, float]:
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = directory / "bucket.safetensors"
    t = time.perf_counter()
    save_file({f"t{i}": x.contiguous() for i, x in enumerate(tensors)}, str(path))
    write = time.perf_counter() - t
    t = time.perf_counter()
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            f.get_tensor(name).clone()     # get_tensor maps the file; clone reads every byte
    read = time.perf_counter() - t
    path.unlink()
    return write, read


BASELINES = ("memcpy", "memcpy_retained", "memcpy_warm", "shm_file_write_read", "safetensors_shm_write_read")


def baseline_round(tensors: list[torch.Tensor], shm: Path,
                   dest: list[torch.Tensor]) -> dict[str, tuple[float, float, float, int]]:
    """One timing of every baseline: name → (total s, write s, read s, minor page faults)."""
    out: dict[str, tuple[float, float, float, int]] = {}
    for name, fn in (("memcpy", memcpy_s), ("memcpy_retained", memcpy_retained_s),
                     ("memcpy_warm", lambda ts: memcpy_warm_s(ts, dest)),
                     ("shm_file_write_read", lambda ts: shm_roundtrip_s(ts, shm)),
                     ("safetensors_shm_write_read", lambda ts: safetensors_roundtrip_s(ts, shm))):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        got = fn(tensors)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        out[name] = (got, 0.0, 0.0, faults) if isinstance(got, float) else (sum(got), got[0], got[1], faults)
    return out


def summarize_baselines(rounds: list[dict[str, tuple[float, float, float, int]]], nbytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"bytes": nbytes}
    for name in BASELINES:
        runs = [r[name][0] for r in rounds]
        s = _median(runs)
        out[name] = {"s": s, "mb_per_s": nbytes / 1e6 / s, "runs_s": runs,
                     "runs_minor_faults": [r[name][3] for r in rounds]}
        if not name.startswith("memcpy"):
            out[name]["write_s"] = _median([r[name][1] for r in rounds])
            out[name]["read_s"] = _median([r[name][2] for r in rounds])
    return out


def bench_model(name: str, fields: dict[str, Any], work: Path, repeats: int, bucket_bytes: int,
                moe_load: str) -> dict[str, Any]:
    from tests.helpers.rollout import start_server, tiny_model_with_tokenizer

    load_before = os.getloadavg()
    t = time.perf_counter()
    model_dir = tiny_model_with_tokenizer(fields, work / name / "model", seed=4)
    build_s = time.perf_counter() - t
    hf = read_hf_config(str(model_dir))
    adapter = weight_map(hf)
    init_parallel(ParallelismConfig(), seed=1)
    actor = Actor(build_model(hf, ParallelismConfig(), torch.float32), 1, None)
    load_hf_into_model(actor.model, str(model_dir), adapter)
    params = [p.detach() for p in unwrap(actor.model).parameters()]
    server = None
    try:
        t = time.perf_counter()
        server = start_server(model_dir, work / name / "run")
        startup_s = time.perf_counter() - t
        t = time.perf_counter()
        server.rpc("mrl_weight_version")
        noop_rpc_s = time.perf_counter() - t
        # Memory bandwidth on this shared VM swings by >10x within seconds, so each sync is paired
        # with a round of baselines right after it (the server idles meanwhile), and the ratios are
        # taken per pair before the median.
        runs, rounds = [], []
        shm = Path(tempfile.mkdtemp(prefix="sync-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        dest = [torch.empty_like(p).copy_(p) for p in params]
        times: dict[str, float] = defaultdict(float)
        endpoint = TimedEndpoint(server, times)
        inner = SharedSegmentTransport([endpoint], segment_bytes=bucket_bytes, moe_load=moe_load)
        try:
            for v in range(1, repeats + 1):
                runs.append(one_sync(actor, adapter, inner, times, v))
                rounds.append(baseline_round(params, shm, dest))
        finally:
            inner.close()
            shutil.rmtree(shm, ignore_errors=True)
        del dest
        final_version = [int(v) for v in server.rpc("mrl_weight_version")]   # the rpc answers strings
        assert final_version == [repeats], final_version
    finally:
        if server is not None:
            server.stop()
    nbytes = sum(p.nbytes for p in params)
    base = summarize_baselines(rounds, nbytes)
    steady = list(zip(runs, rounds))[1:] or list(zip(runs, rounds))    # in-place rewrites (see above)
    paired = {f"ratio_vs_{name}": _median([r["mb_per_s"] / (nbytes / 1e6 / rnd[name][0]) for r, rnd in steady])
              for name in BASELINES}
    keys = [k for k in runs[0] if k.endswith(("_s", "_faults")) or k in ("mb_per_s", "minor_faults")]
    median = {k: _median([r[k] for r, _ in steady]) for k in keys}
    sync_mbs = median["mb_per_s"]
    warm_s = _median([rnd["memcpy_warm"][0] for _, rnd in steady])
    summary = {"steady_sync_s": median["total_s"], "memcpy_warm_s": warm_s,
               "ratio_memcpy_warm_over_sync": warm_s / median["total_s"],
               "ratio_paired_median": paired["ratio_vs_memcpy_warm"], "target": 0.25}
    print(f"[sync_bench] {name} ({nbytes / 1e6:.0f} MB, engine, moe {moe_load}): steady sync "
          f"{summary['steady_sync_s']:.3f} s, warm memcpy {warm_s:.3f} s, ratio {summary['ratio_paired_median']:.3f} "
          f"(paired median; of medians {summary['ratio_memcpy_warm_over_sync']:.3f}); target >= 0.25",
          file=sys.stderr, flush=True)
    result = {
        "summary": summary, "transport": "engine", "moe_load": moe_load,
        "model": {"fields": fields, "dir": str(model_dir), "parameters": sum(p.numel() for p in params),
                  "expected_parameters": hf_param_count(fields), "bytes": base["bytes"],
                  "mb": base["bytes"] / 1e6, "dtype": "float32", "build_or_reuse_s": build_s},
        "server_startup_s": startup_s, "noop_rpc_s": noop_rpc_s,
        "sync_bytes": runs[0]["bytes"], "tensors": runs[0]["tensors"], "parts": runs[0]["parts"],
        "segments": runs[0]["segments"], "segment_bytes": bucket_bytes, "server_result": runs[-1]["server_result"],
        "first_sync": {k: runs[0][k] for k in keys},
        "sync_median_after_first": median,
        "sync_runs": [{k: v for k, v in r.items() if k != "server_result"} for r in runs],
        "baselines": base,
        "ratios_paired_median_after_first": paired,
        "ratios_of_medians_after_first": {f"ratio_vs_{name}": sync_mbs / base[name]["mb_per_s"] for name in BASELINES},
        "share_of_sync_time": {k: median[k] / median["total_s"] for k in
                               ("gather_convert_s", "write_segments_s", "server_reload_s", "control_rpcs_s")},
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    }
    del actor, params
    return result


class _Bf16Server(RolloutServer):
    """The tests' server settings (`start_server`: fp32), in bf16: the trainer's sync dtype."""

    def __init__(self, model: str, run_dir: Path, cfg: RolloutConfig, **kwargs: Any) -> None:
        super().__init__(model, run_dir, dataclasses.replace(cfg, dtype="bfloat16"), **kwargs)


class _TimedWithStats(TimedTransport):
    """`TimedTransport` with the round's `stats` (`sync/bytes`, …) for `sync_weights` to report."""

    @property
    def stats(self) -> Any:
        return self.inner.stats


class _Digesting:
    """The transport, checksumming what the trainer hands it (the delta policy left alone)."""

    def __init__(self, inner: SharedSegmentTransport) -> None:
        self.inner, self.digests = inner, {}
        self.stats = inner.stats

    def begin(self, version: int) -> None:
        self.inner.begin(version)

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        from megatron_rl.rollout.engines.digest import tensor_digest

        self.digests.update({n: tensor_digest(t) for n, t in tensors.items()})
        self.inner.send_bucket(tensors)

    def finish(self, names: list[str]) -> dict[str, Any]:
        result = self.inner.finish(names)
        self.stats = self.inner.stats
        return result

    def abort(self) -> None:
        self.inner.abort()


def bench_delta(work: Path, repeats: int, bucket_bytes: int) -> dict[str, Any]:
    """Delta vs dense syncs of one bf16 MoE (`DELTA`) into one real server, side by side: before
    each pair, one optimizer step of the recipe's AdamW (lr 1e-6, weight decay 0.1, β2 0.95,
    recipes/base/medical_rl.yaml) on a random GRPO batch; then the same weights through a delta
    transport and through a dense one (each its own segments in /dev/shm). Medians of `repeats`
    pairs. At the end one more step, synced by both with the workers checksumming every tensor
    they load: equal to the trainer's, and the server's log-probs equal after either."""
    from megatron_rl.config.schema import AlgorithmConfig, TrainerConfig
    from megatron_rl.megatron.actor import Training
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.sync.diagnose import compare
    from megatron_rl.sync.routes import one_result
    from tests.helpers.rollout import start_server, tiny_model_with_tokenizer
    from tests.mp.layouts_worker import make_batch

    model_dir = tiny_model_with_tokenizer(DELTA, work / "delta" / "model", seed=4)
    hf = read_hf_config(str(model_dir))
    adapter = weight_map(hf)
    init_parallel(ParallelismConfig(), seed=1)
    trainer = TrainerConfig(lr=1e-6, weight_decay=0.1, adam_beta2=0.95, lr_decay_style="cosine")
    actor = Actor(build_model(hf, ParallelismConfig(), torch.bfloat16), 2,
                  Training(trainer, ParallelismConfig(), total_updates=100))
    load_hf_into_model(actor.model, str(model_dir), adapter)
    actor.optimizer.reload_model_params()
    batch = make_batch(hf["vocab_size"], rows=4, length=32)
    step_s: list[float] = []

    def train(step: int) -> None:
        t = time.perf_counter()
        batch.old_logprobs = actor.compute_logprobs(batch, temperature=1.0)
        batch.ref_logprobs = batch.old_logprobs.clone()
        actor.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=step)
        step_s.append(time.perf_counter() - t)

    server = start_server(model_dir, work / "delta" / "run", server_cls=_Bf16Server)
    delta = SharedSegmentTransport([server], segment_bytes=bucket_bytes, delta="on", dense_every=10**6)
    dense = SharedSegmentTransport([server], segment_bytes=bucket_bytes)
    version, pairs, phases = 0, [], []

    def sync(t: Any) -> Any:
        nonlocal version
        version += 1
        report = sync_weights(actor.model, adapter, t, version, torch.bfloat16)
        assert report is not None and report.sent is not None
        return report

    def timed_sync(t: SharedSegmentTransport) -> tuple[Any, dict[str, float]]:
        """One sync with its phases: the trainer's send (delta: compare and patch writes; dense:
        segment writes) and finish (the servers' load, then a delta's patches into the segments),
        a delta round's own split of them, and the worker's (`engines.shm.PHASES`)."""
        times: dict[str, float] = defaultdict(float)
        report = sync(_TimedWithStats(t, times))
        phases = {"send_s": times["send_bucket"], "finish_s": times["finish"]}
        if not t.stats.dense:
            phases.update({f"trainer_{k}": v for k, v in t.stats.seconds.items()})
        loaded = one_result(server.rpc("mrl_loaded"))
        phases.update({f"server_{k}": v for k, v in loaded.get("seconds", {}).items()})
        return report, phases

    try:
        sync(delta), sync(dense)                                   # the first rounds: whole
        for step in range(repeats):
            train(step)
            (d, d_phases), (w, w_phases) = timed_sync(delta), timed_sync(dense)
            assert not d.sent["dense"] and w.sent["dense"], (d.sent, w.sent)
            pairs.append({"delta_s": d.seconds, "dense_s": w.seconds, "delta_bytes": d.sent["bytes"],
                          "dense_bytes": w.sent["bytes"], "changed_frac": d.sent["changed_frac"]})
            phases.append({**{f"delta_{k}": v for k, v in d_phases.items()},
                           **{f"dense_{k}": v for k, v in w_phases.items()}})
        train(repeats)
        probe = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37]] * 2
        client = RolloutClient.for_server(server)
        checks = {}
        for name, t in (("delta", delta), ("dense", dense)):
            server.rpc("mrl_digest_arm")
            recorder = _Digesting(t)
            sync(recorder)
            differ = compare(recorder.digests, [(server.base_url, server.rpc("mrl_digests"))]).differ
            checks[name] = {"tensors": len(recorder.digests), "differ": sorted(differ),
                            "logprobs": client.prompt_logprobs(probe), "dense": recorder.stats.dense}
    finally:
        delta.close()
        dense.close()
        server.stop()
    med = {k: _median([p[k] for p in pairs]) for k in pairs[0]}
    summary = {"changed_frac": med["changed_frac"], "delta_bytes": med["delta_bytes"],
               "dense_bytes": med["dense_bytes"], "bytes_ratio": med["delta_bytes"] / med["dense_bytes"],
               "delta_s": med["delta_s"], "dense_s": med["dense_s"], "time_ratio": med["delta_s"] / med["dense_s"],
               "digests_equal": checks["delta"]["differ"] == checks["dense"]["differ"] == [] and
               checks["delta"]["tensors"] == checks["dense"]["tensors"] > 0 and not checks["delta"]["dense"],
               "logprobs_equal": checks["delta"]["logprobs"] == checks["dense"]["logprobs"],
               "targets": {"bytes_ratio": 0.10, "time_ratio": 0.4}}
    by_phase = {k: _median([p[k] for p in phases]) for k in phases[0]}
    print(f"[sync_bench] delta phases (median s): {json.dumps({k: round(v, 3) for k, v in by_phase.items()})}",
          file=sys.stderr, flush=True)
    print(f"[sync_bench] delta: changed {summary['changed_frac']:.4f}, bytes {summary['bytes_ratio']:.3f} of dense, "
          f"time {summary['delta_s']:.3f} s vs {summary['dense_s']:.3f} s ({summary['time_ratio']:.2f}x), "
          f"digests equal {summary['digests_equal']}", file=sys.stderr, flush=True)
    return {"summary": summary, "pairs": pairs, "median": med, "phases_median_s": by_phase, "phases": phases,
            "train_step_s": step_s,
            "model": {"fields": DELTA, "parameters": hf_param_count(DELTA), "bytes": 2 * hf_param_count(DELTA),
                      "dtype": "bfloat16"},
            "optimizer": {"lr": trainer.lr, "weight_decay": trainer.weight_decay, "adam_beta2": trainer.adam_beta2,
                          "lr_decay_style": trainer.lr_decay_style},
            "checks": {k: {kk: vv for kk, vv in v.items() if kk != "logprobs"} for k, v in checks.items()},
            "segment_bytes": bucket_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "sync_bench",
                    help="checkpoints and server run dirs (checkpoints are reused when unchanged)")
    ap.add_argument("--models", default="tiny,large", help="comma list of: tiny, large")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--bucket-mb", type=int, default=RolloutConfig().sync_bucket_mb,
                    help="MiB per segment (rollout.sync_bucket_mb)")
    ap.add_argument("--moe-load", choices=MOE_LOADS, default=MOE_LOAD,
                    help="how the server loads the MoE experts (rollout/engines/shm.py)")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--delta", action="store_true", help="delta vs dense syncs of a bf16 MoE (bench_delta)")
    args = ap.parse_args()
    # SIGTERM → SystemExit, so the finally blocks stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch.distributed as dist

    from megatron_rl.train.run import init_process_group
    from tests.helpers.rollout import TINY_MOE

    specs = {"tiny": TINY_MOE, "large": LARGE}
    t0 = time.perf_counter()
    out: dict[str, Any] = {"benchmark": "weight_sync_file_transport", "repeats": args.repeats,
                           "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                           "loadavg_start": os.getloadavg(), "models": {}}
    init_process_group()
    try:
        if args.delta:
            out["benchmark"] = "weight_sync_delta"
            out["delta"] = bench_delta(args.dir, max(5, args.repeats), args.bucket_mb << 20)
        for name in [] if args.delta else args.models.split(","):
            out["models"][name] = bench_model(name, specs[name], args.dir, args.repeats, args.bucket_mb << 20,
                                              args.moe_load)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    emit(out, t0, args.json_out)


if __name__ == "__main__":
    main()
