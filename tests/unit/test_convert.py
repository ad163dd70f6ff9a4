"""HF ↔ Megatron checkpoint conversion: bit-exact round trips, logits parity with transformers,
and failures that list every bad tensor and leave no output behind.

The distributed cases run in ONE torchrun launch (tests/mp/convert_worker.py, 2 gloo processes);
the tests below read its report. Add an architecture by adding one line to `CASES`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_rl.convert.job import ConversionError, ConvertLayout, parse_size
from megatron_rl.weights.hf_io import CheckpointError, HFCheckpointReader
from megatron_rl.weights.progress import ByteProgress
from megatron_rl.weights.stream_io import PlannedHFWriter, TensorInfo, lossless_dtype, read_header


# ------------------------------------------------------------------ pieces, no processes
@pytest.mark.parametrize("layout,world", [
    (ConvertLayout(), 1), (ConvertLayout(tp=2), 2), (ConvertLayout(ep=2), 2),
    (ConvertLayout(tp=2, ep=2, etp=1), 2), (ConvertLayout(tp=2, ep=2), 4), (ConvertLayout(tp=4, pp=2, ep=8, etp=1), 16),
    (ConvertLayout(tp=2, pp=3), 6),
])
def test_world_size_rule(layout: ConvertLayout, world: int) -> None:
    assert layout.world_size() == world

def test_bad_layout_and_sizes_are_rejected() -> None:
    with pytest.raises(ConversionError):
        ConvertLayout(tp=0).world_size()
    assert parse_size("500MB") == 500_000_000 and parse_size("2GiB") == 2 << 30 and parse_size("123") == 123
    with pytest.raises(ValueError):
        parse_size("lots")

def test_planned_writer_takes_tensors_in_any_order(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).bfloat16(), "c": torch.arange(6).reshape(2, 3),
               "d": torch.tensor([True, False]), "e": torch.zeros(0, 4)}
    plan = [TensorInfo(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = PlannedHFWriter(tmp_path / "out", plan, max_shard_bytes=40)
    for name in ("c", "e", "a", "d", "b"):
        writer.add(name, tensors[name])
    out = writer.finish()
    reader = HFCheckpointReader(out)
    assert len(reader.shard_files()) == 4          # [a 60 B] [b 14 B] [c 48 B] [d 2 B, e 0 B] at ≤ 40 B
    for name, t in tensors.items():
        got = reader.get(name)
        assert got.dtype == t.dtype and torch.equal(got, t)
    assert read_header(reader.shard_files()[0])["a"] == plan[0]

def test_planned_writer_rejects_surprises_and_refuses_to_finish_incomplete(tmp_path: Path) -> None:
    writer = PlannedHFWriter(tmp_path / "out", [TensorInfo("a", (2, 2), torch.float32),
                                                 TensorInfo("b", (3,), torch.float32)])
    with pytest.raises(CheckpointError, match="not in the write plan"):
        writer.add("z", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match="planned"):
        writer.add("a", torch.zeros(2, 3))
    writer.add("a", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match="twice"):
        writer.add("a", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match="never written: b"):
        writer.finish()
    writer.abort()
    assert list(tmp_path.iterdir()) == []

def test_params_dtype_holds_every_checkpoint_dtype_exactly() -> None:
    assert lossless_dtype({torch.bfloat16}) == torch.bfloat16
    assert lossless_dtype({torch.bfloat16, torch.float32}) == torch.float32
    assert lossless_dtype({torch.bfloat16, torch.float16}) == torch.float32     # not one of the two
    assert lossless_dtype({torch.float32, torch.float64}) == torch.float64
    x = torch.randn(1000).to(torch.float16)
    assert torch.equal(x.to(torch.float32).to(torch.float16), x)

def test_progress_line_reports_bytes_rate_and_eta() -> None:
    import io

    stream = io.StringIO()
    bar = ByteProgress("copy", 4 << 20, stream, log_interval=0.0)
    bar.start -= 2.0                     # as if 2 s had passed
    bar.update(1 << 20)
    # The printed line (its rate a hair under 512 KiB/s: the update came a moment after the 2 s),
    # then the same line at exactly 2 s.
    assert re.fullmatch(r"copy: 1\.0 MiB / 4\.0 MiB \( 25\.0%\) \d+\.\d KiB/s ETA 0:00:0\d",
                        stream.getvalue().splitlines()[-1])
    assert bar.line(bar.start + 2.0) == "copy: 1.0 MiB / 4.0 MiB ( 25.0%) 512.0 KiB/s ETA 0:00:06"
