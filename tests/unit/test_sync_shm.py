"""The `shm` transport's bookkeeping (`sync/shm.py`, pure logic): where tensors land in the
segments, what the manifest says, what stays on disk; the order of the weight-transfer calls of a
round, re-initialising a restarted server's engine, one written copy and one manifest for every
server (write once), and a worker report that does not match what was sent. The server side is a
recording stub here; the real servers are in test_rollout_server.py, test_weight_sync.py,
test_weight_transfer.py, test_verification_servers.py and test_disaggregated.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.rollout.engines.loaded import check_loaded, views
from megatron_rl.sync.routes import ServersFailed
from megatron_rl.sync.shm import ALIGN, SegmentLayout, SharedSegmentTransport


class EngineRecorder:
    """Answers the routes as a server with the `mrl_shm` engine does, decoding every update's
    tensors from the files its manifest names (the bytes as they are now, through the engine's own
    decoder: what the server would load is checked byte for byte)."""

    def __init__(self, name: str = "a") -> None:
        self.base_url, self.token, self.restarts = f"http://{name}", "t", 0
        self.calls: list[str] = []
        self.manifests: list[dict[str, Any]] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.version = 0
        self.lie = False
        self.timeouts: dict[str, float] = {}
        self.meet: threading.Barrier | None = None
        """Set: each load waits there for the other servers' loads (which must be under way too)."""
        self.load_spans: list[tuple[float, float]] = []
        self.fail = ""
        self.patched = 0

    def post(self, path: str, body: Any = None, params: Any = None, timeout: float = 600.0) -> None:
        self.calls.append(path)
        self.timeouts[path] = timeout
        if path == "/update_weights":
            start = time.monotonic()
            if self.meet is not None:
                self.meet.wait()
            if self.fail:
                raise RuntimeError(self.fail)
            info = body["update_info"]
            self.manifests.append(info)
            segments = [torch.frombuffer(bytearray(Path(p).read_bytes()[:size]), dtype=torch.uint8)
                        for p, size in info["segments"]]
            self.loaded = {name: t.clone() for name, t in views(info["tensors"], segments)}
            self.patched = _apply_patches(self.loaded, info)
            self.version = info["version"]
            self.load_spans.append((start, time.monotonic()))
        if path == "/finish_weight_update":
            assert body == {"weight_version": str(self.version)}

    def rpc(self, method: str, *args: str, timeout: float = 600.0) -> list[Any]:
        """The workers' own check (`WorkerExtension.mrl_check_loaded`), two workers."""
        self.calls.append(method)
        assert method == "mrl_check_loaded"
        record = {"version": self.version, "tensors": len(self.loaded) - self.lie}
        return [check_loaded(record, args[0], f"worker {i}") for i in range(2)]


def _apply_patches(loaded: dict[str, torch.Tensor], info: dict[str, Any]) -> int:
    """A delta round's patches (`sync/delta.PatchEntry` rows) onto the previous version, decoded
    here independently of the engine: indices and values at their places in the patch files."""
    files = [Path(p).read_bytes()[:size] for p, size in info.get("patch_segments", [])]
    for name, dtype, _shape, index_dtype, count, (iseg, ioff), (vseg, voff) in info.get("patches", []):
        dt = getattr(torch, dtype)
        values = torch.frombuffer(bytearray(files[vseg][voff:voff + count * dt.itemsize]), dtype=dt)
        flat = loaded[name].reshape(-1)
        if index_dtype is None:
            flat.copy_(values)
        else:
            it = getattr(torch, index_dtype)
            flat[torch.frombuffer(bytearray(files[iseg][ioff:ioff + count * it.itemsize]), dtype=it).long()] = values
    return len(info.get("patches", []))


ROUND = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "mrl_check_loaded",
         "/reset_prefix_cache", "/resume"]


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


def _update(t: SharedSegmentTransport, version: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    t.begin(version)
    names = list(tensors)
    t.send_bucket({n: tensors[n] for n in names[:2]})
    t.send_bucket({n: tensors[n] for n in names[2:]})
    return t.finish(names)


@pytest.mark.parametrize("shared_dir", [False, True], ids=["in_place", "shared_dir"])
def test_what_the_server_loads_is_what_was_sent_every_update(shared_dir: bool, tmp_path: Path) -> None:
    server = EngineRecorder()
    t = SharedSegmentTransport([server], tmp_path / "sync" if shared_dir else None, segment_bytes=512)
    try:
        dirs = []
        for version in (1, 2, 3):
            sent = _tensors(version)
            server.calls = []
            assert _update(t, version, sent)["version"] == version
            assert set(server.loaded) == set(sent)
            for name, tensor in sent.items():
                assert server.loaded[name].dtype == tensor.dtype and torch.equal(server.loaded[name], tensor), name
            assert [c for c in server.calls if c != "/init_weight_transfer_engine"] == ROUND
            dirs.append(t.latest[2])
        if shared_dir:
            assert len(set(dirs)) == 3 and [d.exists() for d in dirs] == [False, False, True]   # only the latest
        else:
            assert len(set(dirs)) == 1                           # one directory, rewritten in place
        assert len(t.layout.sizes) > 1                           # 512-byte segments: really split
        assert t.links[0].resend_latest()["version"] == 3 and torch.equal(server.loaded["d"], _tensors(3)["d"])
    finally:
        t.close()
    assert not any(d.exists() for d in dirs)


def test_incomplete_update_is_refused_before_the_server_is_touched(tmp_path: Path) -> None:
    server = EngineRecorder()
    t = SharedSegmentTransport([server], None, segment_bytes=512)
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
        server = EngineRecorder()
        t = SharedSegmentTransport([server], root, segment_bytes=512)
        try:
            _update(t, 1, _tensors(1))
            t.begin(2)
            t.send_bucket({"a": torch.zeros(3, 5)})
            t.abort()
            if resendable:
                assert t.links[0].resend_latest()["version"] == 1 and torch.equal(server.loaded["a"], _tensors(1)["a"])
            else:
                with pytest.raises(RuntimeError, match="partly overwritten"):
                    t.links[0].resend_latest()
            assert _update(t, 3, _tensors(3))["version"] == 3     # a full update recovers either way
            assert t.links[0].resend_latest()["version"] == 3
        finally:
            t.close()


def _allocated(directory: Path) -> int:
    """Bytes the directory's files hold in RAM / on disk (sparse files: only what was written)."""
    return sum(f.stat().st_blocks * 512 for f in directory.iterdir())


def test_in_place_segments_shrink_after_a_large_update_and_grow_back() -> None:
    """QLoRA: the first sync sends the whole base, later ones only the adapted tensors. In place
    (/dev/shm) the segments the small update does not need are deleted, and a segment whose large
    tensor moved on gets a smaller file; what the server loads is what was sent every time."""
    kib = 1 << 10
    g = torch.Generator().manual_seed(0)
    full = {"embed": torch.randn(4 * kib, generator=g),                          # 16 KiB: its own segment
            **{f"layer{i}": torch.randn(kib, generator=g) for i in range(12)}}   # 4 KiB each
    small = {"embed": torch.randn(64, generator=g), "layer0": torch.randn(kib, generator=g)}
    server = EngineRecorder()
    t = SharedSegmentTransport([server], None, segment_bytes=8 * kib)
    try:
        for version, sent in enumerate((full, small, full, small), start=1):
            _update(t, version, sent)
            assert set(server.loaded) == set(sent) and all(torch.equal(server.loaded[n], x) for n, x in sent.items())
            directory = t.latest[2]
            files = sorted(directory.iterdir())
            assert [Path(p) for p, _ in server.manifests[-1]["segments"]] == files    # nothing else is left
            if sent is full:     # embed alone (16 KiB), then 12 × 4 KiB in pairs: 7 segments, ~64 KiB
                assert [f.stat().st_size for f in files] == [16 * kib] + [8 * kib] * 6
            else:                # one 8 KiB segment: embed (256 B) and layer0 (4 KiB)
                assert [f.stat().st_size for f in files] == [8 * kib]
                assert _allocated(directory) <= 8 * kib
        assert t.links[0].resend_latest()["version"] == 4
        assert all(torch.equal(server.loaded[n], x) for n, x in small.items())
    finally:
        t.close()


def test_update_timeouts_grow_with_the_bytes() -> None:
    """audit-5 #4: QLoRA's first sync of Qwen3-235B is one /update_weights of 470 GB; its timeout
    is the control requests' 600 s plus the bytes at 1 GB/s, /finish_weight_update's too. Pure
    function, then through the real round of the shm link (the manifest's segment bytes)."""
    from megatron_rl.rollout.server import CONTROL_TIMEOUT_S
    from megatron_rl.sync.routes import UPDATE_FLOOR_BYTES_PER_S, update_timeout_s

    assert (CONTROL_TIMEOUT_S, UPDATE_FLOOR_BYTES_PER_S) == (600.0, 1e9)
    assert update_timeout_s(0) == update_timeout_s(-1) == 600.0
    assert update_timeout_s(470.2e9) == pytest.approx(1070.2)
    assert update_timeout_s(512 << 20) == pytest.approx(600.0 + 0.536870912)
    server = EngineRecorder()
    t = SharedSegmentTransport([server], None, segment_bytes=1 << 20)
    try:
        _update(t, 1, {"a": torch.zeros(3 << 20, dtype=torch.uint8), "b": torch.zeros(10, dtype=torch.uint8)})
        segments = sum(size for _, size in server.manifests[-1]["segments"])
        assert segments == (3 << 20) + (1 << 20)           # a: its own 3 MiB segment, b: one of 1 MiB
        assert server.timeouts["/update_weights"] == server.timeouts["/finish_weight_update"] \
            == pytest.approx(600.0 + segments / 1e9)
        assert server.timeouts["/pause"] == 600.0
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
from megatron_rl.sync.shm import SegmentWriter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
t = SegmentWriter(Path({str(tmp_path)!r}) / "sync", segment_bytes=1 << 16)
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


def test_a_trainer_that_exits_without_closing_leaves_no_segments_and_its_forked_children_none_removed() -> None:
    """The in-place segments are a copy of the weights in RAM: an exit that never reaches close()
    (an error on the way out) removes them; a forked child that exits does not take them away."""
    import subprocess
    import sys

    code = """
import os, torch
from megatron_rl.sync.shm import SegmentWriter
t = SegmentWriter(None, segment_bytes=1 << 16)
t.begin(1)
t.send_bucket({"w": torch.ones(100)})
print(t.dir, flush=True)
child = os.fork()
if child == 0:
    raise SystemExit(0)           # a normal exit of the child: its atexit hooks run
os.waitpid(child, 0)
print("after child", t.dir.is_dir(), flush=True)
raise RuntimeError("crash before close()")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 1 and "crash before close()" in out.stderr, out.stdout + out.stderr
    segments, after_child = out.stdout.splitlines()
    assert after_child == "after child True"
    assert Path(segments).name.startswith("megatron-rl-sync-") and not Path(segments).exists()


def _send(transport: SharedSegmentTransport, version: int, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    transport.begin(version)
    names = sorted(state)
    for start in range(0, len(names), 2):
        transport.send_bucket({n: state[n] for n in names[start:start + 2]})
    return transport.finish(names)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.w": torch.randn(33, 7, generator=g) for i in range(5)}


def test_round_order_and_a_restarted_server_gets_its_engine_initialised_again(tmp_path: Path) -> None:
    server = EngineRecorder("a")
    transport = SharedSegmentTransport([server], None, segment_bytes=1 << 10)
    try:
        result = _send(transport, 1, _state(0))
        assert result == {"version": 1, "tensors": 5, "workers": 2, "servers": 1}
        assert server.calls == ["/pause", "/init_weight_transfer_engine"] + ROUND[1:]
        server.calls = []
        _send(transport, 2, _state(1))
        assert server.calls == ROUND                                    # initialised once per server process
        server.restarts, server.calls = 1, []
        assert transport.links[0].resend_latest() == {"version": 2, "tensors": 5, "workers": 2}
        assert server.calls == ["/pause", "/init_weight_transfer_engine"] + ROUND[1:]
        assert all(torch.equal(server.loaded[n], t) for n, t in _state(1).items())
    finally:
        transport.close()


def test_two_servers_read_one_written_copy_per_version(tmp_path: Path) -> None:
    servers = [EngineRecorder("a"), EngineRecorder("b")]
    root = tmp_path / "sync"
    transport = SharedSegmentTransport(servers, root, segment_bytes=1 << 10)
    try:
        for version in (1, 2):
            state = _state(version)
            assert _send(transport, version, state)["servers"] == 2
            assert servers[0].manifests[-1] == servers[1].manifests[-1]            # the same manifest
            for s in servers:
                assert all(torch.equal(s.loaded[n], t) for n, t in state.items())
            dirs = list(root.iterdir())                       # the previous version went once both loaded
            assert len(dirs) == 1
            written = sum(f.stat().st_size for f in dirs[0].iterdir())
            assert written < 2 * sum(t.nbytes for t in state.values())               # one copy, not two
    finally:
        transport.close()


def test_every_server_loads_at_once_and_a_failing_one_is_named_after_the_others_finished(tmp_path: Path) -> None:
    """Audit 3 finding 7: the servers loaded one after another. Each load here waits at a barrier
    for the other server's load, which only passes if both are under way at the same time (one
    after another, the first waits out the barrier's timeout and the sync fails)."""
    servers = [EngineRecorder("a"), EngineRecorder("b")]
    meet = threading.Barrier(2, timeout=20)
    for s in servers:
        s.meet = meet
    transport = SharedSegmentTransport(servers, tmp_path / "sync", segment_bytes=1 << 10)
    try:
        state = _state(1)
        assert _send(transport, 1, state)["servers"] == 2
        (a0, a1), (b0, b1) = servers[0].load_spans[-1], servers[1].load_spans[-1]
        assert a0 < b1 and b0 < a1                                      # the two loads overlap in time
        for s in servers:
            assert all(torch.equal(s.loaded[n], t) for n, t in state.items())
        servers[1].fail = "its /dev/shm vanished"
        with pytest.raises(ServersFailed, match=r"failed on 1 of 2 servers: http://b: RuntimeError: its /dev/shm"):
            _send(transport, 2, _state(2))
        assert servers[0].version == 2 and servers[0].calls[-1] == "/resume"    # a's round went through
        assert servers[1].calls[-1] == "/resume"                               # b serves again (old weights)
    finally:
        transport.close()


def test_a_worker_report_that_does_not_match_what_was_sent_is_an_error() -> None:
    server = EngineRecorder("a")
    server.lie = True
    transport = SharedSegmentTransport([server], None, segment_bytes=1 << 10)
    try:
        with pytest.raises(RuntimeError, match=r"check failed on worker 0: loaded \{'version': 1, 'tensors': \d+\}"):
            _send(transport, 1, _state(0))
        assert server.calls[-1] == "/resume"                                        # serving again
    finally:
        transport.close()


def test_the_workers_check_compares_only_the_fields_sent_and_names_the_worker() -> None:
    record = {"version": 3, "tensors": 12, "moe_layers_repacked": 2}
    assert check_loaded(record, '{"version": 3, "tensors": 12}', "w") == record
    assert check_loaded({"version": None, "tensors": 4}, '{"version": null, "tensors": 4}', "w")["tensors"] == 4
    with pytest.raises(RuntimeError, match=r"on DP rank 1, worker rank 0: loaded \{'version': 2\}, the trainer sent"):
        check_loaded(record | {"version": 2}, '{"version": 3}', "DP rank 1, worker rank 0")
    with pytest.raises(RuntimeError, match="'tensors': None"):
        check_loaded({"version": 3}, '{"version": 3, "tensors": 12}', "w")        # nothing loaded


def test_a_restarted_qlora_server_is_brought_back_only_to_the_whole_base(tmp_path: Path) -> None:
    """QLoRA's first update is the whole (dequantized NF4) base, later ones only the adapted
    tensors: a restarted server, back on the original base, can take the first again, not a later
    one (the run stops, to be resumed, rather than serve a mix of the two bases)."""
    server = EngineRecorder()
    t = SharedSegmentTransport([server], tmp_path / "sync", segment_bytes=512)
    try:
        t.links[0].deltas_after_first = True
        _update(t, 1, _tensors(1))
        assert t.links[0].resend_latest()["version"] == 1                          # the whole base again
        t.begin(2)
        t.send_bucket({"a": _tensors(2)["a"]})
        t.finish(["a"])
        with pytest.raises(RuntimeError, match="update 2 holds only the adapted tensors .* Resume the run"):
            t.links[0].resend_latest()
    finally:
        t.close()
