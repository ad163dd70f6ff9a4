"""Delta sync on the `shm` transport (`sync/delta.py`, trainer side): which rounds go dense, what a
delta round writes, and that the server's tensors after it are bit for bit the new version (a
digest of every tensor). The server is the recording stub of test_sync_shm (decoding each update,
patches included, from the files); the real engine's side is in
tests/integration/test_weight_sync.py::test_delta_sync_is_bit_identical_and_a_wrong_index_is_named."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron_rl.rollout.engines.digest import tensor_digest
from megatron_rl.sync.delta import DeltaPolicy, break_even, changed, whole_only
from megatron_rl.sync.shm import SharedSegmentTransport
from tests.unit.test_sync_shm import EngineRecorder


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.w": torch.randn(64, 48, generator=g).to(torch.bfloat16) for i in range(4)} | \
        {"model.norm.weight": torch.ones(48, dtype=torch.bfloat16)}


def _step(state: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """About `frac` of each matrix's elements moved by one bf16 ulp or more (the norm unchanged)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        hit = torch.rand(t.shape, generator=g) < frac if t.dim() == 2 else torch.zeros(t.shape, dtype=torch.bool)
        out[name] = torch.where(hit, t.float() * 1.01 + 1e-3, t.float()).to(t.dtype)
    return out


def _sync(t: SharedSegmentTransport, version: int, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    t.begin(version)
    names = list(state)
    for start in range(0, len(names), 2):
        t.send_bucket({n: state[n] for n in names[start:start + 2]})
    return t.finish(names)


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {n: tensor_digest(x) for n, x in tensors.items()}


def test_the_policy_sends_the_first_round_and_every_nth_dense() -> None:
    p = DeltaPolicy("auto", dense_every=3)
    assert not p.wants_delta(has_base=False)                        # nothing to compare with
    kinds = []
    for _ in range(6):
        delta = p.wants_delta(has_base=True)
        kinds.append(delta)
        p.done(dense=not delta)
    assert kinds == [True, True, False, True, True, False]          # every 3rd version dense
    p.dense_next = True
    assert not p.wants_delta(True) and not DeltaPolicy("off").wants_delta(True)
    assert break_even(torch.bfloat16, 10) == pytest.approx(1 / 3) and break_even(torch.float32, 10) == 0.5
    a = torch.tensor([0.0, 1.0, float("nan")])
    assert changed(torch.tensor([-0.0, 1.0, float("nan")]), a).tolist() == [0]   # bitwise: -0.0 is a change


def test_a_delta_round_sends_only_the_changes_and_the_server_holds_the_new_version_bit_for_bit() -> None:
    server = EngineRecorder("a")
    t = SharedSegmentTransport([server], None, segment_bytes=8 << 10, delta="auto", dense_every=10)
    try:
        v1 = _model(0)
        _sync(t, 1, v1)
        assert t.stats.dense and server.patched == 0
        assert not any(t.stats.seconds.values())                           # a dense round: no delta phases
        dense_bytes = t.stats.bytes
        v2 = _step(v1, 0.03, 1)
        assert _sync(t, 2, v2) == {"version": 2, "tensors": 5, "workers": 2, "servers": 1}
        assert not t.stats.dense and server.patched == 4                    # the norm did not change
        # The delta phases are timed for the bench, outside the metric keys.
        assert set(t.stats.seconds) == {"compare_s", "write_s", "apply_s"}
        assert all(s > 0 for s in t.stats.seconds.values()), t.stats.seconds
        assert set(t.stats.report()) == {"bytes", "changed_frac", "dense"}
        assert t.stats.bytes <= 0.10 * dense_bytes, (t.stats.bytes, dense_bytes)
        frac = sum(changed(v2[n], v1[n]).numel() for n in v1) / sum(x.numel() for x in v1.values())
        assert t.stats.report()["changed_frac"] == pytest.approx(frac)
        assert _digests(server.loaded) == _digests(v2)                    # every tensor, bit for bit
        # The segments hold version 2 now: a restarted server gets it whole.
        server.restarts += 1
        assert t.links[0].resend_latest()["version"] == 2 and server.patched == 0
        assert _digests(server.loaded) == _digests(v2)
        # Past the break-even a tensor goes whole; the rest stays sparse.
        v3 = dict(v2, **{"model.layers.0.w": _step({"x": v2["model.layers.0.w"]}, 0.9, 2)["x"]})
        _sync(t, 3, v3)
        rows = {r[0]: r for r in server.manifests[-1]["patches"]}
        assert rows["model.layers.0.w"][3] is None and rows.keys() == {"model.layers.0.w"}
        assert _digests(server.loaded) == _digests(v3)
    finally:
        t.close()


def test_a_stream_unlike_the_last_one_goes_dense_and_a_failed_round_makes_the_next_dense() -> None:
    server = EngineRecorder("a")
    t = SharedSegmentTransport([server], None, segment_bytes=8 << 10, delta="on")
    try:
        v1 = _model(0)
        _sync(t, 1, v1)
        fewer = {n: x for n, x in _step(v1, 0.02, 3).items() if n != "model.layers.3.w"}
        _sync(t, 2, fewer)                                  # a tensor less (LoRA / QLoRA after the base)
        assert t.stats.dense and "patches" not in server.manifests[-1]
        assert _digests(server.loaded) == _digests(fewer)
        renamed = {("model.layers.9.w" if n == "model.layers.1.w" else n): x for n, x in fewer.items()}
        _sync(t, 3, renamed)                               # another tensor in the middle of the stream
        assert t.stats.dense and _digests(server.loaded) == _digests(renamed)
        server.fail = "the engine died"
        with pytest.raises(RuntimeError, match="the engine died"):
            _sync(t, 4, _step(renamed, 0.02, 4))
        server.fail = ""
        _sync(t, 5, _step(renamed, 0.02, 5))
        assert t.stats.dense                                # after a failed round: whole again
    finally:
        t.close()


def test_a_server_restarted_during_a_delta_round_gets_the_previous_version_whole_then_the_patches() -> None:
    server = EngineRecorder("a")
    t = SharedSegmentTransport([server], None, segment_bytes=8 << 10, delta="auto")
    link = t.links[0]
    seen: list[int] = []

    def restarted_once(phase: str, fn: Any, *args: Any) -> Any:
        """What the supervisor does when the server dies under the round: restart, bring it back
        to the latest complete version, redo the round."""
        if not seen:
            server.restarts += 1
            seen.append(link.resend_latest()["version"])
            assert _digests(server.loaded) == _digests(v1)         # the segments hold version 1 whole
        return fn(*args)

    try:
        v1 = _model(0)
        _sync(t, 1, v1)
        link.supervise = restarted_once
        v2 = _step(v1, 0.03, 1)
        _sync(t, 2, v2)
        assert seen == [1] and not t.stats.dense
        assert _digests(server.loaded) == _digests(v2)
    finally:
        t.close()


def test_a_nan_weight_stops_a_delta_round_naming_it_before_the_server_loads_any_of_it() -> None:
    """vLLM's patch loader refuses NaN values (NaN marks "unchanged"): the trainer stops, naming the
    tensor, before anything of the round is written, instead of every delta failing on the server."""
    server = EngineRecorder("a")
    t = SharedSegmentTransport([server], None, segment_bytes=8 << 10, delta="on")
    try:
        v1 = _model(1)
        _sync(t, 1, v1)
        bad = _step(v1, 0.02, 6)
        bad["model.layers.2.w"][5, 7] = float("nan")
        with pytest.raises(RuntimeError, match=r"model\.layers\.2\.w holds NaN"):
            _sync(t, 2, bad)
        t.abort()                                               # as `sync_weights` does on an error
        assert _digests(server.loaded) == _digests(v1)          # the server kept the last version
        v3 = _step(v1, 0.02, 7)
        _sync(t, 3, v3)                                         # nothing of round 2 landed: a delta from v1
        assert _digests(server.loaded) == _digests(v3)
    finally:
        t.close()


def test_on_is_refused_for_servers_reading_the_shared_run_dir(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="rollout.sync_delta: 'on' .* shared run dir"):
        SharedSegmentTransport([EngineRecorder("a")], tmp_path / "sync", segment_bytes=1024, delta="on")


def test_validate_refuses_on_where_every_version_goes_whole_and_accepts_it_on_one_node() -> None:
    from pathlib import Path

    from tests.unit.test_gpu_refusals import PRODUCTION, errors

    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "grpo.yaml"
    assert "sync-delta" not in errors(tiny, "rollout.sync_delta=on")     # (YAML reads on as true: still "on")
    (msg,) = errors(tiny, "rollout.sync_delta=on", "rollout.sleep_level=2")["sync-delta"]
    assert "level-2 sleep drops the servers' weights" in msg
    from megatron_rl.config import load_recipe

    accepted = []
    for recipe in PRODUCTION:       # none a single colocated node; shm to rollout nodes: their /dev/shm copies
        r = load_recipe(recipe, []).rollout
        if r.placement == "disaggregated" and r.weight_transfer == "shm":
            assert "sync-delta" not in errors(recipe, "rollout.sync_delta=on"), recipe
            accepted.append(recipe.parent.name + "/" + recipe.stem)
            continue
        (msg,) = errors(recipe, "rollout.sync_delta=on")["sync-delta"]
        assert msg.startswith("rollout.sync_delta: 'on' is not supported here"), (recipe, msg)
        assert "sync-delta" not in errors(recipe)                   # auto: whole there, no error
    assert "qwen3_235b_a22b/grpo" in accepted and "qwen3_next_80b_a3b/gspo" in accepted, accepted


def test_a_short_convolution_always_goes_whole() -> None:
    """GPU re-audit 4 #1: vLLM loads Gated DeltaNet's conv1d by slice assignment, which would copy a
    sparse patch's NaN marks into the weights; one changed element of it sends the tensor whole."""
    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert whole_only(conv) and not whole_only("model.layers.0.linear_attn.in_proj_qkvz.weight")
    server = EngineRecorder("a")
    t = SharedSegmentTransport([server], None, segment_bytes=8 << 10, delta="auto", dense_every=10)
    try:
        v1 = _model(0) | {conv: torch.randn(64, 1, 4, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)}
        _sync(t, 1, v1)
        v2 = dict(v1)
        v2[conv] = v1[conv].clone()
        v2[conv][0, 0, 0] += 1
        v2["model.layers.1.w"] = _step({"x": v1["model.layers.1.w"]}, 0.03, 1)["x"]
        _sync(t, 2, v2)
        rows = {r[0]: r for r in server.manifests[-1]["patches"]}
        assert rows.keys() == {conv, "model.layers.1.w"}
        assert rows[conv][3] is None and rows["model.layers.1.w"][3] is not None   # whole / sparse
        assert _digests(server.loaded) == _digests(v2)
    finally:
        t.close()

