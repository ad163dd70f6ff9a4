"""bench/logprobs_bench.py --fused end to end on a small shape: the JSON a reader compares (each
variant's measured peak and time, the fused head's ratios), and the GPU options' refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "logprobs_bench.py"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300,
                          check=False)


def test_fused_rows_report_measured_peaks_times_and_the_fused_heads_ratios() -> None:
    done = _bench("--fused", "--tokens-list", "64,128", "--vocab", "4096", "--hidden", "64",
                  "--variants", "chunked_fwd_bwd,fused_fwd_bwd")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert (out["device"], out["dtype"]) == ("cpu", "fp32")
    assert [row["tokens"] for row in out["rows"]] == [64, 128]
    for row in out["rows"]:
        for name in ("chunked_fwd_bwd", "fused_fwd_bwd"):
            got = row["variants"][name]
            assert got["peak_extra_bytes"] >= 0 and got["seconds"] > 0, (name, got)
        assert row["variants"]["naive_fwd"] == {"not_run": "not in --variants"}
        ratio = row["fused_vs_chunked_fwd_bwd"]
        want = row["variants"]["fused_fwd_bwd"]["seconds"] / row["variants"]["chunked_fwd_bwd"]["seconds"]
        assert ratio["time"] == want


def test_gpu_options_are_refused_where_they_cannot_apply() -> None:
    done = _bench("--device", "cuda")
    assert done.returncode != 0 and "only --fused runs on a GPU" in done.stderr
    done = _bench("--fused", "--dtype", "fp16")
    assert done.returncode != 0 and "invalid choice: 'fp16'" in done.stderr
