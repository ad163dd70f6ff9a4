"""HF ↔ Megatron checkpoint conversion: bit-exact round trips, logits parity with transformers,
and failures that list every bad tensor and leave no output behind.

The distributed cases run in ONE torchrun launch (tests/mp/convert_worker.py, 2 gloo processes);
the tests below read its report. Add an architecture by adding one line to `CASES`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from megatron_rl.weights.hf_io import HFCheckpointReader, HFCheckpointWriter
from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.helpers.models import DENSE_TIED, TINY_QWEN3_NEXT
from tests.mp.launch import REPO, torchrun

MOE = yaml.safe_load((REPO / "recipes/tiny/base.yaml").read_text())["model"]["tiny"]


_MOE_ONLY = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size")


@dataclass(frozen=True)
class Case:
    fields: dict[str, Any]
    # Layout names from tests/mp/convert_worker.py:layout(). Round trips go HF → Megatron at each
    # layout → HF at the next one (cyclically); logits are compared at the parity layouts.
    layouts: tuple[str, ...] = ("tp1", "tp2_ep2", "pp2")
    parity_layouts: tuple[str, ...] = ("tp1", "tp2_ep2")


# One line per architecture; every round-trip and parity test runs on each.
CASES: dict[str, Case] = {
    "qwen3_dense_tied": Case(DENSE_TIED),
    "qwen3_moe": Case(MOE),
    # Dense MLPs among MoE ones (decoder_sparse_step 2, mlp_only_layers): MoE only at layer 1.
    "qwen3_moe_dense_layers": Case({**MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    "qwen3_next": Case(TINY_QWEN3_NEXT),
}


EXPORT_CASE = "qwen3_moe"        # the failure cases use this one


# fp32 end to end; the two implementations differ only in reduction order (measured ≈1e-6).
LOGITS_ATOL = 1e-4


def _noisy_sharded_copy(base: Path, out: Path) -> Path:
    """The tiny checkpoint with distinct norm weights (HF initialises them to 1, which would let a
    swapped norm pass) saved as ~3 shards with an index, so sharded reading is exercised."""
    reader = HFCheckpointReader(base)
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for name in sorted(reader.names()):
        t = reader.get(name).clone()
        if t.dim() == 1:
            t += 0.1 * torch.randn(t.shape, generator=g)
        tensors[name] = t
    total = sum(t.nbytes for t in tensors.values())
    writer = HFCheckpointWriter(out, max_shard_bytes=total // 3 + 1)
    writer.add_many(tensors.items())
    return writer.finish(side_files_from=base)


def _reference_logits(hf_dir: Path, vocab: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return {"tokens": tokens, "logits": model(tokens).logits}


def _broken_copy(src: Path, dst: Path, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None,
                 reshape: dict[str, tuple[int, ...]] | None = None) -> Path:
    reader = HFCheckpointReader(src)
    writer = HFCheckpointWriter(dst, max_shard_bytes=300_000)
    for name in reader.names():
        if name in drop:
            continue
        t = reader.get(name)
        if reshape and name in reshape:
            t = torch.zeros(reshape[name], dtype=t.dtype)
        writer.add(name, t)
    writer.add_many((add or {}).items())
    return writer.finish(side_files_from=src)


def _truncated_copy(src: Path, dst: Path) -> Path:
    """A download cut short: the shard holding the final norm (read last) loses its tail."""
    shutil.copytree(src, dst)
    reader = HFCheckpointReader(dst)
    last = dst / reader.weight_map["model.norm.weight"]
    assert last != dst / reader.weight_map["model.embed_tokens.weight"]   # the first reads succeed
    os.truncate(last, last.stat().st_size - 64)
    return dst


BROKEN = {
    "missing": dict(drop=("model.layers.1.mlp.experts.3.up_proj.weight", "model.norm.weight")),
    "unexpected": dict(add={"model.layers.0.mlp.shared_expert.up_proj.weight": torch.zeros(8, 64)}),
    "misshaped": dict(reshape={"model.layers.0.self_attn.q_proj.weight": (96, 64), "lm_head.weight": (511, 64)}),
}
BROKEN["all_three"] = {**BROKEN["missing"], **BROKEN["unexpected"], **BROKEN["misshaped"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("convert")
    spec: dict[str, Any] = {"cases": {}, "broken": {}, "export_case": EXPORT_CASE, "work": str(root / "failures")}
    reference = {}
    for name, case in CASES.items():
        base = build_tiny_hf_checkpoint(case.fields, root / f"{name}_base", seed=0)
        src = _noisy_sharded_copy(base, root / name)
        reference[name] = _reference_logits(src, case.fields["vocab_size"])
        (root / name / "work").mkdir(parents=True, exist_ok=True)
        spec["cases"][name] = {"hf_dir": str(src), "layouts": list(case.layouts), "work": str(root / name / "work"),
                               "parity_layouts": list(case.parity_layouts), "max_shard_bytes": 250_000}
    export_src = Path(spec["cases"][EXPORT_CASE]["hf_dir"])
    for kind, edits in BROKEN.items():
        spec["broken"][kind] = str(_broken_copy(export_src, root / f"bad_{kind}", **edits))
    spec["broken"]["truncated"] = str(_truncated_copy(export_src, root / "bad_truncated"))
    Path(spec["work"]).mkdir()
    torch.save(reference, root / "reference.pt")
    spec["reference"] = str(root / "reference.pt")
    (root / "spec.json").write_text(json.dumps(spec))
    torchrun("convert_worker.py", str(root / "spec.json"), str(root / "result.json"))
    return {"spec": spec, "result": json.loads((root / "result.json").read_text()), "reference": reference}


def assert_identical(a: Path, b: Path) -> None:
    """Same tensor names, dtypes and bits; same config."""
    ra, rb = HFCheckpointReader(a), HFCheckpointReader(b)
    assert sorted(ra.names()) == sorted(rb.names())
    for name in ra.names():
        x, y = ra.get(name), rb.get(name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


# ------------------------------------------------------------------ the CLI (real exit codes)
def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", *args], env=env,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------ round trips and parity
@pytest.mark.parametrize("case", CASES)
def test_round_trip_is_bit_identical(run: dict[str, Any], case: str) -> None:
    got = run["result"]["cases"][case]["roundtrip"]
    names = CASES[case].layouts
    assert set(got) == {f"{a}->{b}" for a, b in zip(names, names[1:] + names[:1])}   # every layout both ways
    for out in got.values():
        assert_identical(Path(run["spec"]["cases"][case]["hf_dir"]), Path(out))
        assert (Path(out) / "generation_config.json").is_file()
        assert len(list(Path(out).glob("model-*.safetensors"))) >= 3     # max_shard_bytes honoured


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(run: dict[str, Any], case: str) -> None:
    parity = run["result"]["cases"][case]["parity"]
    assert set(parity) == set(CASES[case].parity_layouts)
    assert run["reference"][case]["logits"].std() > 0.05     # the tolerance is small against the logits
    for layout, diff in parity.items():
        assert diff <= LOGITS_ATOL, (case, layout, diff)


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize("kind,names", [
    ("missing", ["missing: model.layers.1.mlp.experts.3.up_proj.weight (expected shape [64, 64])",
                 "missing: model.norm.weight (expected shape [64])"]),
    ("unexpected", ["unexpected: model.layers.0.mlp.shared_expert.up_proj.weight (shape [8, 64], torch.float32)"]),
    ("misshaped", ["wrong shape: model.layers.0.self_attn.q_proj.weight: checkpoint has [96, 64], "
                   "model expects [128, 64]",
                   "wrong shape: lm_head.weight: checkpoint has [511, 64], model expects [512, 64]"]),
])
def test_mismatched_checkpoint_is_listed_and_nothing_written(run: dict[str, Any], kind: str,
                                                              names: list[str]) -> None:
    got = run["result"]["failures"][kind]
    assert got["type"] == "ConversionError"
    assert sorted(got["problems"]) == sorted(names)
    assert "nothing was written" in got["message"] and all(n in got["message"] for n in names)
    assert got["left"] == []


def test_all_mismatches_come_in_one_error(run: dict[str, Any]) -> None:
    got = run["result"]["failures"]["all_three"]
    assert got["type"] == "ConversionError" and len(got["problems"]) == 5 and got["left"] == []


def test_truncated_shard_fails_midway_and_leaves_nothing(run: dict[str, Any]) -> None:
    got = run["result"]["failures"]["truncated"]
    assert got["type"] == "CheckpointError"
    assert "bad_truncated/model-0000" in got["message"] and "cannot read" in got["message"]
    assert got["left"] == []                 # neither the output nor its temporary directories


def test_interrupted_export_leaves_nothing(run: dict[str, Any]) -> None:
    got = run["result"]["failures"]["interrupted_export"]
    assert got["type"] == "RuntimeError" and "simulated interruption" in got["message"]
    assert got["left"] == []


def test_cli_lists_mismatches_and_exits_1(run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "mc"
    proc = _cli("hf-to-mcore", "--hf", run["spec"]["broken"]["all_three"], "--out", str(out))
    assert proc.returncode == 1, proc.stderr
    assert "5 problem(s)" in proc.stderr and "missing: model.norm.weight" in proc.stderr
    assert "wrong shape: lm_head.weight" in proc.stderr and "unexpected: model.layers.0.mlp" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_exports_and_refuses_to_overwrite(run: dict[str, Any], tmp_path: Path) -> None:
    case = run["spec"]["cases"][EXPORT_CASE]
    mc, out, stats = Path(case["work"]) / f"mc_{case['layouts'][1]}", tmp_path / "hf", tmp_path / "stats.json"
    proc = _cli("mcore-to-hf", "--mcore", str(mc), "--out", str(out), "--max-shard-size", "200KB",
                "--stats-json", str(stats))
    assert proc.returncode == 0, proc.stderr
    assert_identical(Path(case["hf_dir"]), out)
    assert "writing HF shards" in proc.stderr and "done:" in proc.stderr
    report = json.loads(stats.read_text())
    assert report["world_size"] == 1 and report["bytes"] > 0 and len(report["peak_rss_per_rank"]) == 1
    again = _cli("mcore-to-hf", "--mcore", str(mc), "--out", str(out))
    assert again.returncode == 1 and "already exists" in again.stderr
