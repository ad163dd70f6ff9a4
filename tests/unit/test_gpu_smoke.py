"""tools/gpu_smoke.sh stays alive in CI: on the CPU it runs the same checks as on a GPU (the world
group, devices, log-probs vs float64, a GRPO step, the NaN guard, QLoRA's NF4 base on the QLoRA
spec) and prints one JSON line."""

from __future__ import annotations

import json
import os
import subprocess

from tests.mp.launch import REPO


def test_gpu_smoke_runs_on_cpu_and_prints_one_json_line() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(REPO / "tools" / "gpu_smoke.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(lines[0])
    assert proc.returncode == 0 and report["ok"], json.dumps(report, indent=1)[-3000:]
    assert report["device"] == "cpu" and report["dtype"] == "bf16"
    assert report["world"] == {"backend": "gloo", "local_rank": 0, "bound_device": "cpu", "all_reduce_cpu": 3.0}
    assert report["qwen3_moe_qlora"]["nf4_modules"] > 0 and report["qwen3_moe_qlora"]["only_adapters_moved"]
    # The QLoRA spec (its local pieces here): the NF4 base lives in megatron-core's local linears.
    assert report["qwen3_moe_qlora"]["spec"] == "qlora-local"
    assert report["qwen3_moe_qlora"]["nf4_holder_classes"] == ["ColumnParallelLinear", "RowParallelLinear"]
    for model in ("qwen3_moe", "qwen3_next", "qwen3_moe_qlora"):
        r = report[model]
        assert r["param_devices"] == ["cpu"] and r["batch_devices"] == ["cpu"]
        assert r["logprob_max_abs_err_vs_fp64"] <= 1e-4
        assert r["update_skipped"] == 0.0 and r["max_weight_change"] > 0
        assert r["nan_guard"] == {**r["nan_guard"], "grad_norm": "nan", "skipped": 1.0, "weights_unchanged": True}
