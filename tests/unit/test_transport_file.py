"""The CPU transport's bookkeeping: where tensors land in the segments, what the manifest says,
what stays on disk. The server side is a recording stub here (pure logic); the real server is in
test_rollout_server.py, test_weight_sync.py and test_disaggregated.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.rollout.worker_ext import _views
from megatron_rl.weights.transport_file import ALIGN, FileTransport, SegmentLayout


class Recorder:
    """Answers the control calls the way the worker extension does, reading the tensors back from
    the files the manifest names (so what the server would load is checked byte for byte)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.loaded: dict[str, torch.Tensor] = {}

    def post(self, path: str, body: Any = None, params: Any = None, timeout: float = 600.0) -> None:
        self.calls.append(path)

    def rpc(self, method: str, *args: str, timeout: float = 600.0) -> list[Any]:
        self.calls.append(method)
        version, manifest = args
        spec = json.loads(manifest)
        # The bytes as they are now, read through the worker's own decoder.
        segments = [torch.frombuffer(bytearray(Path(p).read_bytes()[:size]), dtype=torch.uint8)
                    for p, size in spec["segments"]]
        self.loaded = {name: t.clone() for name, t in _views(spec["tensors"], segments)}
        return [{"version": int(version), "tensors": len(spec["tensors"])}]


def test_layout_fills_segments_in_order_aligned_and_gives_big_tensors_their_own() -> None:
    layout = SegmentLayout(capacity=1000)
    assert layout.place(10) == (0, 0)
    assert layout.place(100) == (0, ALIGN)                       # aligned start
    assert layout.place(900) == (1, 0)                          # would cross: next segment
    assert layout.place(5000) == (2, 0)                         # bigger than a segment: its own
    assert layout.place(1) == (3, 0)
    assert layout.sizes == [ALIGN + 100, 900, 5000, 1]
    again = SegmentLayout(capacity=1000)
    assert [again.place(n) for n in (10, 100, 900, 5000, 1)] == [(0, 0), (0, ALIGN), (1, 0), (2, 0), (3, 0)]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.randn(40, generator=g).to(torch.bfloat16),
            "c": torch.randint(0, 9, (7,), generator=g), "empty": torch.empty(0, 4),
            "d": torch.randn(300, 2, generator=g)}


def _update(t: FileTransport, version: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    t.begin(version)
    names = list(tensors)
    t.send_bucket({n: tensors[n] for n in names[:2]})
    t.send_bucket({n: tensors[n] for n in names[2:]})
    return t.finish(names)


@pytest.mark.parametrize("shared_dir", [False, True], ids=["in_place", "shared_dir"])
def test_what_the_server_loads_is_what_was_sent_every_update(shared_dir: bool, tmp_path: Path) -> None:
    server = Recorder()
    t = FileTransport(server, tmp_path / "sync" if shared_dir else None, segment_bytes=512)
    try:
        dirs = []
        for version in (1, 2, 3):
            sent = _tensors(version)
            assert _update(t, version, sent)["version"] == version
            assert set(server.loaded) == set(sent)
            for name, tensor in sent.items():
                assert server.loaded[name].dtype == tensor.dtype and torch.equal(server.loaded[name], tensor), name
            assert server.calls[-4:] == ["/pause", "mrl_update", "/reset_prefix_cache", "/resume"]
            dirs.append(t.latest[2])
        if shared_dir:
            assert len(set(dirs)) == 3 and [d.exists() for d in dirs] == [False, False, True]   # only the latest
        else:
            assert len(set(dirs)) == 1                           # one directory, rewritten in place
        assert len(t.layout.sizes) > 1                           # 512-byte segments: really split
        assert t.resend_latest()["version"] == 3 and torch.equal(server.loaded["d"], _tensors(3)["d"])
    finally:
        t.close()
    assert not any(d.exists() for d in dirs)


def test_incomplete_update_is_refused_before_the_server_is_touched(tmp_path: Path) -> None:
    server = Recorder()
    t = FileTransport(server, None, segment_bytes=512)
    try:
        t.begin(1)
        t.send_bucket({"a": torch.ones(2)})
        with pytest.raises(RuntimeError, match="1 tensors written, 2 expected"):
            t.finish(["a", "b"])
        assert server.calls == []
    finally:
        t.close()


def test_aborted_in_place_update_blocks_resending_but_a_shared_dir_keeps_the_latest(tmp_path: Path) -> None:
    for root, resendable in ((None, False), (tmp_path / "sync", True)):
        server = Recorder()
        t = FileTransport(server, root, segment_bytes=512)
        try:
            _update(t, 1, _tensors(1))
            t.begin(2)
            t.send_bucket({"a": torch.zeros(3, 5)})
            t.abort()
            if resendable:
                assert t.resend_latest()["version"] == 1 and torch.equal(server.loaded["a"], _tensors(1)["a"])
            else:
                with pytest.raises(RuntimeError, match="partly overwritten"):
                    t.resend_latest()
            assert _update(t, 3, _tensors(3))["version"] == 3     # a full update recovers either way
            assert t.resend_latest()["version"] == 3
        finally:
            t.close()


def test_no_room_for_the_segments_is_an_error_naming_the_directory(tmp_path: Path) -> None:
    """A mapped file whose pages cannot be allocated would kill the trainer with SIGBUS on first
    touch; the transport reserves each range first and raises instead. The file-size limit stands
    in for a full /dev/shm (same failing call), in a child process so pytest keeps its limits."""
    import subprocess
    import sys

    code = f"""
import resource, signal, torch
from pathlib import Path
from megatron_rl.weights.transport_file import FileTransport
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
t = FileTransport(None, Path({str(tmp_path)!r}) / "sync", segment_bytes=1 << 16)
t.begin(1)
t.send_bucket({{"small": torch.zeros(1000)}})
try:
    t.send_bucket({{"big": torch.zeros(1 << 20)}})
except OSError as exc:
    print("ERROR:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert "ERROR:" in out.stdout, out.stdout + out.stderr
    message = out.stdout.split("ERROR:", 1)[1]
    assert "cannot allocate 4.0 MiB" in message and str(tmp_path / "sync") in message, message
