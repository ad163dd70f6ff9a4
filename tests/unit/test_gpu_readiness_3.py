"""Audit 3's GPU findings whose logic runs on the CPU (../shared/notes/gpu-readiness-audit-3.md):
the GPU tests' inputs on the model's device and their TF32 switch, the image self-test's order,
and the weight transports' early failures."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


class _DeviceStrictModel(torch.nn.Module):
    """GPTModel's call signature with CUDA's rule: inputs on another device than the weights raise
    (the meta device stands in for the GPU; F.embedding on meta accepts anything)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Parameter(torch.zeros(8, 4, device="meta"))
        self.embedding.main_grad = torch.zeros(8, 4, device="meta")   # type: ignore[attr-defined]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: Any) -> torch.Tensor:
        for t in (tokens, positions):
            if t.device != self.embedding.device:
                raise RuntimeError(f"Expected all tensors to be on the same device, got {t.device} "
                                   f"and {self.embedding.device}")
        return self.embedding[tokens] + positions[..., None]


def test_memory_options_worker_feeds_the_model_on_its_own_device() -> None:
    """Audit 3 #1: tests/gpu/test_cpu_offload.py's worker built its tokens on the host and fed them
    to the CUDA GPTModel, so the first option set crashed before the offloaded optimizer stepped."""
    sys.path.insert(0, str(REPO / "tests" / "mp"))
    try:
        from tests.mp.memory_options_worker import saved_activation_bytes
    finally:
        sys.path.remove(str(REPO / "tests" / "mp"))
    tokens = torch.randint(0, 8, (2, 5))                 # the worker's batch: on the host
    nbytes, grads = saved_activation_bytes(_DeviceStrictModel(), tokens)
    assert isinstance(nbytes, int)                      # meta storages have no address to count
    assert set(grads) == {"embedding"} and grads["embedding"].device.type == "meta"


def test_gpu_tests_switch_tf32_off_and_say_so() -> None:
    """Audit 3 #2: under the NGC base's TF32 override the fp32 GPU bounds fail; tests/gpu/conftest.py
    turns both switches off for the run and its children and names what it found."""
    from tests.gpu.conftest import TF32_OFF, tf32_off

    ngc = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1", "PATH": "/usr/bin"}
    header = tf32_off(ngc)
    assert ngc == {**TF32_OFF, "PATH": "/usr/bin"}
    assert "TF32 off" in header and "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE was '1'" in header
    assert "was" not in tf32_off({})
    # torch reads the override as a boolean: "0" must be one of its false spellings.
    assert TF32_OFF["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] in ("0", "OFF", "NO", "FALSE", "N")


def _fleet_with_gate_results(diagnoses: list[Any], over_gate: list[bool]) -> Any:
    """A WeightPublisher whose probe statistics and diagnoses are given (the collective parts are the
    servers' and the gather's; what is tested is the decision after a failed gate)."""
    from megatron_rl.config.schema import RecipeConfig
    from megatron_rl.sync import verify as verification
    from megatron_rl.train.publisher import WeightPublisher

    fleet = object.__new__(WeightPublisher)
    fleet.rank0, fleet.intact_misses = True, 0
    fleet.cfg = RecipeConfig()
    fleet.check_replicas = lambda _v: None                                # type: ignore[method-assign]
    bad, good = torch.tensor([0.5, 0.9, 1.0, 1.0]), torch.tensor([1e-3, 2e-3, 3e-3, 3e-3])
    stats = iter([bad if o else good for o in over_gate])
    fleet._probe_stats = lambda *_a: next(stats)[:len(verification.STATS)]   # type: ignore[method-assign]
    diag = iter(diagnoses)
    fleet.diagnose = lambda *_a: next(diag)                               # type: ignore[method-assign]
    return fleet


def test_a_failed_gate_with_every_tensor_intact_warns_and_three_in_a_row_stop(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Audit 3 #6: one bf16 excursion over the gate, with the checksums proving the weights arrived
    byte for byte, used to end the run; now it warns and goes on, and a checksum mismatch (or three
    intact failures in a row) still stops."""
    from types import SimpleNamespace

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.sync import verify as verification
    from megatron_rl.sync.diagnose import Diagnosis
    from megatron_rl.train.publisher import misses_after_failed_gate
    from megatron_rl.train.run import Stop

    intact = Diagnosis(sent=10, workers=["w0", "w1"])
    broken = Diagnosis(sent=10, workers=["w0"], differ={"model.layers.0.mlp.down_proj.weight": {"bytes": ["w0"]}})
    assert misses_after_failed_gate(intact, 1) == 2
    assert misses_after_failed_gate(broken, 1) == 0
    assert misses_after_failed_gate(Diagnosis(error="arming failed"), 1) == 0
    assert misses_after_failed_gate(Diagnosis(sent=10), 0) == 0                # no worker reported
    policy = SimpleNamespace(dtype=torch.bfloat16)
    gate = verification.Gate((0.01, 0.02, 0.03, 0.03)[:len(verification.STATS)],
                             verification.Limits(mean=0.02, p90=0.05))
    fleet = _fleet_with_gate_results([intact], [True, False])
    metrics = fleet.verify(policy, None, 5, gate)
    assert metrics["sync/verify_intact_misses"] == 1.0 and "training goes on" in capsys.readouterr().out
    assert "sync/verify_intact_misses" not in fleet.verify(policy, None, 6, gate) and fleet.intact_misses == 0
    in_row = RolloutConfig().verify_failures_in_row                     # the recipe key's default
    assert misses_after_failed_gate(Diagnosis(sent=10, workers=["w0"],
                                              reloaded={"s DP engine 1": ["embed_tokens.weight"]}), 1) == 0
    fleet = _fleet_with_gate_results([intact] * in_row, [True] * in_row)
    for version in range(in_row - 1):
        fleet.verify(policy, None, version, gate)
    with pytest.raises(Stop, match=f"{in_row} failed gates in a row"):
        fleet.verify(policy, None, 9, gate)
    with pytest.raises(Stop, match="reached the 1 vLLM worker other than the trainer sent"):
        _fleet_with_gate_results([broken], [True]).verify(policy, None, 3, gate)


def test_a_refused_weight_update_raises_before_rank0_enters_the_broadcast() -> None:
    """Audit 3 #12: NcclTransport posted /update_weights on threads and entered NCCL at once; a
    request refused before vLLM's workers joined left rank 0 in a broadcast with no timeout."""
    import time

    from megatron_rl.sync.gpu import SETTLE_S, _on_threads

    entered: list[str] = []

    def refused() -> None:
        raise RuntimeError("400 Bad Request: unknown weight name")

    def slow_ok() -> None:
        time.sleep(0.05)

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="400 Bad Request"):
        _on_threads([slow_ok, refused], lambda: entered.append("broadcast"), SETTLE_S)
    assert entered == [] and time.monotonic() - start < SETTLE_S     # raised as soon as it was refused
    # Accepted requests: the broadcast runs after the settle time, and a late error still raises.
    _on_threads([slow_ok], lambda: entered.append("broadcast"), 0.01)
    assert entered == ["broadcast"]

    def late_refusal() -> None:
        time.sleep(0.1)
        raise RuntimeError("500 from a worker")

    with pytest.raises(RuntimeError, match="500 from a worker"):
        _on_threads([late_refusal], lambda: entered.append("again"), 0.0)
    assert entered == ["broadcast", "again"]


def test_the_node_sender_group_gets_the_runs_collective_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit 3 #11: `dist.new_group` without a timeout takes torch's 30-minute default, not the
    run's `trainer.collective_timeout_min` (torch/distributed/distributed_c10d.py `_new_group_with_tag`)."""
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_rl.sync.nodes import open_sender_group
    from megatron_rl.topology import ShmSender

    made: list[tuple[list[int], Any]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout=None: made.append((ranks, timeout)) or "group")
    senders = [ShmSender(rank=8 * k, node=k, servers=(k,), shared=False) for k in range(3)]
    assert open_sender_group(senders, 45.0) == "group"
    assert made == [([0, 8, 16], timedelta(minutes=45))]
    assert open_sender_group(senders[:1], 45.0) is None and len(made) == 1


def test_a_tiny_model_gets_its_tokenizer_without_the_demo_warmup(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit 3 #15: the GPU tests' tiny servers took their tokenizer from the demo assets, whose
    200-step supervised warm-up a fresh image spent a minute on before any GPU test."""
    from tests.helpers import rollout
    from tests.helpers.models import TINY_MOE

    def no_warmup() -> dict[str, Path]:
        raise AssertionError("the demo's warmed-up assets were built for a tokenizer")

    def checkpoint(fields: dict, out: Path, seed: int = 0) -> Path:     # the random weights: not what is tested
        out.mkdir()
        return out

    monkeypatch.setattr(rollout, "demo_assets", no_warmup)
    monkeypatch.setattr(rollout, "build_tiny_hf_checkpoint", checkpoint)
    model = rollout.tiny_model_with_tokenizer(TINY_MOE, tmp_path / "model")
    assert (model / "tokenizer.json").is_file() and (model / "tokenizer_config.json").is_file()
