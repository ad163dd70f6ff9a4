"""What the first GPU run needs, proven on CPU where the same code runs: Transformer-Engine
parameter names in the weight map, one metrics writer, vLLM's per-worker RPC results, the
server's environment and sampling defaults, bf16-aware verification statistics, the TE log-prob
glue, and the device placement of a batch."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch


# ---------------------------------------------------------------------------- pure logic
def test_one_result_per_vllm_worker_must_agree() -> None:
    from megatron_rl.sync.routes import one_result

    same = {"version": 3, "tensors": 33, "moe_layers_repacked": 2}
    assert one_result([same, dict(same)]) == {**same, "workers": 2}        # TP 2: two answers
    assert one_result([same]) == {**same, "workers": 1}
    with pytest.raises(RuntimeError, match="workers disagree"):
        one_result([same, {**same, "version": 2}])
    with pytest.raises(RuntimeError, match="no worker result"):
        one_result([])
    # Each worker's phase timings differ by nature: equal otherwise, the slowest phase is kept.
    timed = [{**same, "seconds": {"load_s": 0.25, "map_s": 0.5}}, {**same, "seconds": {"load_s": 0.5, "map_s": 0.125}}]
    assert one_result(timed) == {**same, "seconds": {"load_s": 0.5, "map_s": 0.5}, "workers": 2}
    with pytest.raises(RuntimeError, match="workers disagree"):
        one_result([timed[0], {**timed[1], "tensors": 32}])

def test_server_environment_drops_torchrun_variables_and_ignores_generation_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.server import RolloutServer

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)     # the server's own choice
    for k, v in {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "n1", "MASTER_PORT": "29500",
                 "TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "0", "KEEP_ME": "1"}.items():
        monkeypatch.setenv(k, v)
    server = RolloutServer(str(tmp_path), tmp_path, RolloutConfig(), 128, token="t")
    env = server.environment()
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "GROUP_RANK"} & set(env)
    assert env["KEEP_ME"] == "1" and env["VLLM_API_KEY"] == "t"
    cmd = server.command()
    assert cmd[cmd.index("--generation-config") + 1] == "vllm"
    if not torch.cuda.is_available():
        # vLLM's CPU auto-binding refuses TP 2 on one NUMA node: each rank gets its own cores.
        monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 5})
        tp2 = RolloutServer(str(tmp_path), tmp_path, RolloutConfig(tensor_parallel_size=2), 128, token="t")
        assert tp2.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,5"
        assert "VLLM_CPU_OMP_THREADS_BIND" not in env                       # TP 1: vLLM's default
        # TP 1 runs its rank in the engine's process (no busy-polling worker beside it); TP 2
        # needs vLLM's worker processes.
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in tp2.environment()
        # Its OpenMP threads leave one CPU to the API process, at most one per physical core; the
        # caller's setting wins; TP 2's ranks have their cores bound (above), no default of ours.
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        physical = {"n": 8}
        monkeypatch.setattr("psutil.cpu_count", lambda logical=True: physical["n"] if not logical else 16)
        assert server.environment()["OMP_NUM_THREADS"] == "3"
        physical["n"] = 2                                  # 4 CPUs of 2 hyperthreaded cores
        assert server.environment()["OMP_NUM_THREADS"] == "2"
        assert "OMP_NUM_THREADS" not in tp2.environment()
        monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0})
        assert server.environment()["OMP_NUM_THREADS"] == "1"
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert server.environment()["OMP_NUM_THREADS"] == "2"

def test_verification_statistics_and_dtype_bounds() -> None:
    from megatron_rl.sync import verify as v

    g = torch.Generator().manual_seed(0)
    noise = torch.randn(2000, generator=g, dtype=torch.float64) * 1e-6
    stats = v.diff_stats(noise)
    ref = noise.abs()
    assert torch.allclose(stats, torch.stack([ref.mean(), ref.quantile(0.9), ref.quantile(0.99), ref.max()]))
    fp32, bf16 = v.limits_for(torch.float32, None), v.limits_for(torch.bfloat16, None)
    assert v.failure(stats, fp32) is None
    outlier = noise.clone()
    outlier[7] = 3e-4                                    # fp32: one token off is already wrong
    assert "max" in v.failure(v.diff_stats(outlier), fp32)
    # bf16: kernel noise plus a few tokens whose expert choice flipped pass; a shift of every
    # token (a wrong tensor) fails; so does a NaN anywhere.
    bf16_noise = torch.randn(2000, generator=g, dtype=torch.float64) * 0.005
    bf16_noise[:10] = 1.5
    assert v.failure(v.diff_stats(bf16_noise), bf16) is None
    assert v.failure(v.diff_stats(bf16_noise + 0.1), bf16) is not None
    bf16_noise[3] = math.nan
    assert "nan" in v.failure(v.diff_stats(bf16_noise), bf16)
    assert v.limits_for(torch.bfloat16, 0.05).mean == 0.05                 # rollout.verify_tolerance
    assert set(v.as_metrics(stats)) >= {"sync/verify_mean_abs_diff", "sync/verify_max_abs_diff"}

def test_te_logprob_glue_divides_by_temperature_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE's kernel is stood in for by a float64 cross-entropy that records its input (TE needs
    CUDA); what is under test is the glue: z/T in fp32 from bf16 logits, signs, shapes."""
    from megatron_rl import logprobs

    seen: list[torch.Tensor] = []

    def parallel_cross_entropy(inp: torch.Tensor, target: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append(inp.clone())
        return -torch.log_softmax(inp.double(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)

    te = types.ModuleType("transformer_engine")
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", types.ModuleType("transformer_engine.pytorch"))
    ce = types.ModuleType("transformer_engine.pytorch.cross_entropy")
    ce.parallel_cross_entropy = parallel_cross_entropy  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.cross_entropy", ce)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 50, generator=g) * 20).to(torch.bfloat16)
    target = torch.randint(0, 50, (6,), generator=g)
    got = logprobs._te_target_logprobs(logits, target, 0.9, None)
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0][0], logits.float() / 0.9)
    ref = torch.log_softmax(logits.double() / 0.9, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    assert got.shape == target.shape and torch.allclose(got.double(), ref, atol=1e-5)
    # fp32 logits that require grad (a leaf): the glue must not divide them in place.
    leaf = logits.float().requires_grad_()
    kept = leaf.detach().clone()
    assert logprobs._te_target_logprobs(leaf, target, 0.9, None) is not None and torch.equal(leaf.detach(), kept)
    # The bf16 division it replaces is measurably off at |z| ~ 20 (a second rounding).
    old = torch.log_softmax((logits / 0.9).double(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    assert (old - ref).abs().max() > 1e-3


def test_te_logprobs_fall_back_on_any_kernel_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit-2 #24: a Triton compile error (any exception, not only TE's asserts) falls back to the
    torch path once, with a warning, instead of crashing `compute_logprobs`."""
    from megatron_rl import logprobs

    def parallel_cross_entropy(*args: Any) -> torch.Tensor:
        raise RuntimeError("triton.compiler.errors.CompilationError: at 12:4")

    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    ce = types.ModuleType("transformer_engine.pytorch.cross_entropy")
    ce.parallel_cross_entropy = parallel_cross_entropy  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.cross_entropy", ce)
    monkeypatch.setattr(logprobs, "_te_disabled", False)
    logits, target = torch.randn(4, 10), torch.randint(0, 10, (4,))
    with pytest.warns(UserWarning, match="RuntimeError: triton"):
        assert logprobs._te_target_logprobs(logits, target, 1.0, None) is None
    assert logprobs._te_disabled


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), torch.distributed.DistError("NCCL")],
                         ids=["oom", "collective"])
def test_te_logprobs_do_not_fall_back_on_errors_that_differ_between_ranks(monkeypatch: pytest.MonkeyPatch,
                                                                          error: Exception) -> None:
    """gpu-readiness audit 3 N1: an OOM (or a failed collective) can hit one TP rank only; falling
    back there alone would pair the torch path's all-reduces with TE's all-gather on the others. It
    is raised, and TE stays enabled."""
    from megatron_rl import logprobs

    def parallel_cross_entropy(*args: Any) -> torch.Tensor:
        raise error

    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    ce = types.ModuleType("transformer_engine.pytorch.cross_entropy")
    ce.parallel_cross_entropy = parallel_cross_entropy  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.cross_entropy", ce)
    monkeypatch.setattr(logprobs, "_te_disabled", False)
    with pytest.raises(type(error)):
        logprobs._te_target_logprobs(torch.randn(4, 10), torch.randint(0, 10, (4,)), 1.0, None)
    assert not logprobs._te_disabled


def test_packed_nccl_broadcast_waits_for_the_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit-2 #11: vLLM's packed producer packs on side streams without waiting for the current
    one, where the gathered tensors were written; the sender synchronises it first. Streams and the
    producer are stood in for (CUDA): what is under test is the order."""
    import contextlib

    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor

    from megatron_rl.rollout import nccl_sender

    events: list[Any] = []

    class Stream:
        def synchronize(self) -> None:
            events.append("current stream synchronized")

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_producer",
                        lambda it, *args: events.append(("producer", [name for name, _ in it])))
    nccl_sender.broadcast(object(), {"a": torch.zeros(2), "b": torch.ones(3)}, torch.device("cuda", 0), packed=True)
    assert events == ["current stream synchronized", ("producer", ["a", "b"])]


def test_train_batch_to_moves_every_tensor() -> None:
    from megatron_rl.types import TrainBatch

    b = TrainBatch(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 4), torch.zeros(2),
                   old_logprobs=torch.zeros(2, 4),
                   sft_tokens=torch.zeros(1, 5, dtype=torch.long), sft_mask=torch.ones(1, 4))
    moved = b.to(torch.device("meta"))
    for name, value in moved.__dict__.items():
        assert value is None or value.device.type == "meta", name
    assert moved.ref_logprobs is None and b.tokens.device.type == "cpu"


def test_calibrated_gate_sits_above_the_noise_floor_never_below_the_dtype_bounds() -> None:
    """Issue 30 item 3 (the server test: tests/integration/test_verification_calibration.py)."""
    from megatron_rl.sync import verify as v

    floor = torch.tensor([0.042, 0.096, 0.22, 0.45], dtype=torch.float64)     # bf16 at |z| ≈ 25 (measured)
    gate = v.calibrate(floor, torch.bfloat16, None)
    assert gate.floor == tuple(floor.tolist())
    assert (gate.limits.mean, gate.limits.p90, gate.limits.max) == (v.NOISE_FACTOR * 0.042, v.NOISE_FACTOR * 0.096,
                                                                    None)
    assert v.failure(floor * 1.1, gate.limits) is None and v.failure(floor * 2.5, gate.limits) is not None
    tiny = v.calibrate(torch.full((4,), 1e-4, dtype=torch.float64), torch.bfloat16, None)
    assert tiny.limits == v.LIMITS[torch.bfloat16]                            # the dtype's bounds are a floor
    fp32 = v.calibrate(torch.tensor([1e-6, 2e-6, 5e-6, 1e-4], dtype=torch.float64), torch.float32, None)
    assert fp32.limits.max == v.NOISE_FACTOR * 1e-4
    fixed = v.calibrate(floor, torch.bfloat16, 0.5)                           # rollout.verify_tolerance: fixed
    assert fixed.limits.mean == 0.5 and fixed.limits == v.limits_for(torch.bfloat16, 0.5)
    # The start-up measurement only has to rule out another model / garbage weights.
    assert v.failure(floor, v.startup_limits(torch.bfloat16, None)) is None
    assert v.failure(floor + 1.0, v.startup_limits(torch.bfloat16, None)) is not None


def test_sampled_probe_verifies_the_sampled_tokens_only() -> None:
    from megatron_rl.sync import verify as v

    prompts, responses = [[5, 6, 7], [8, 9]], [list(range(10, 22)), list(range(30, 40))]
    probe = v.sampled_probe(prompts, responses, seq_len=16, pad=0)
    assert probe is not None and probe.tokens.shape == (2, 16) and probe.mask.shape == (2, 15)
    assert probe.tokens[0].tolist() == [5, 6, 7] + list(range(10, 22)) + [0]
    assert probe.mask[0].nonzero().flatten().tolist() == list(range(2, 14))   # predicts tokens 3..14
    assert probe.tokens[1].tolist()[:12] == [8, 9] + list(range(30, 40))
    assert int(probe.mask.sum()) == 22
    cut = v.sampled_probe(prompts, responses, seq_len=12, pad=0)              # responses cut at seq_len
    assert cut is not None and int(cut.mask.sum()) == 9 + 10
    assert v.sampled_probe(prompts, [[1], []], seq_len=16, pad=0) is None    # too few: the forced probe
