"""bench/lora_memory.py on a small wide model: the planner predicts the trainer's parameter,
gradient and optimizer bytes of full, LoRA and QLoRA training within 15 % (here: to the byte but
for torchao's per-tensor constants), and QLoRA's base is about 1/8 of the fp32 one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_memory_matches_the_planner(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "bench/lora_memory.py"), "--hidden", "512", "--experts", "4",
           "--vocab", "1024", "--json-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    modes = json.loads(out.read_text())["modes"]
    for mode in ("full", "lora", "qlora"):
        got = modes[mode]
        assert "failed" not in got, got.get("failed")
        assert got["within_tolerance"] and abs(got["ratio"]["static"] - 1) < 0.01, (mode, got["ratio"])
        assert got["measured"]["grads"] == 4 * got["trainable_params"]                  # fp32 main grads
        assert got["measured"]["optimizer"] == 8 * got["trainable_params"]              # Adam m and v
    full, lora, qlora = (modes[m]["measured"] for m in ("full", "lora", "qlora"))
    assert modes["lora"]["trainable_params"] < 0.01 * modes["full"]["trainable_params"]
    assert lora["params"] > full["params"]                                   # base + adapters
    assert qlora["params"] < 0.3 * lora["params"]       # linears at ~0.52 of 4 bytes; embedding, output in fp32
