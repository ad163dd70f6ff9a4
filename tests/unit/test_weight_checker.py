"""vLLM's /weight_checker answers compared across servers and DP engines (`sync/checker.py`): the
keys as vLLM 0.32's workers build them (`vllm/v1/worker/gpu_worker.py:367-378`), a replica that
differs named with its parameters, the majority as reference, and a tie naming both."""

from __future__ import annotations

import pytest

from megatron_rl.sync.checker import Checked, by_engine, changed, disagreements


def _answer(dps: int, **override: str) -> dict[str, str]:
    """One server's /weight_checker checksums: `dps` engines of TP 2, two parameters each."""
    sums = {}
    for dp in range(dps):
        for tp in range(2):
            for name in ("model.embed_tokens.weight", "model.layers.0.mlp.experts.w13_weight"):
                key = f"dp{dp}:pp0:pcp0:tp{tp}:{name}"
                sums[key] = override.get(key, f"sha-tp{tp}-{name}")
    return sums


def test_every_engine_of_every_server_agrees() -> None:
    checked = Checked({**by_engine("http://a", _answer(2)), **by_engine("http://b", _answer(2))})
    assert sorted(checked.replicas) == ["http://a DP engine 0", "http://a DP engine 1",
                                        "http://b DP engine 0", "http://b DP engine 1"]
    assert checked.disagreements() == {} and checked.message(7) is None


def test_the_engine_that_differs_is_named_with_its_parameters() -> None:
    bad = "dp1:pp0:pcp0:tp1:model.layers.0.mlp.experts.w13_weight"
    checked = Checked({**by_engine("http://a", _answer(2, **{bad: "other"})), **by_engine("http://b", _answer(2))})
    assert checked.disagreements() == {"http://a DP engine 1": ["pp0:pcp0:tp1:model.layers.0.mlp.experts.w13_weight"]}
    message = checked.message(7)
    assert message is not None and "version 7" in message and "http://a DP engine 1: 1 parameter" in message
    # A parameter one replica lacks is a difference too.
    missing = _answer(1)
    del missing["dp0:pp0:pcp0:tp0:model.embed_tokens.weight"]
    assert disagreements({**by_engine("x", missing), **by_engine("y", _answer(1)), **by_engine("z", _answer(1))}) \
        == {"x DP engine 0": ["pp0:pcp0:tp0:model.embed_tokens.weight"]}


def test_two_replicas_that_differ_are_both_named() -> None:
    """No majority between two: which one is right is not the checker's to say."""
    key = "dp1:pp0:pcp0:tp0:model.embed_tokens.weight"
    got = disagreements(by_engine("http://a", _answer(2, **{key: "other"})))
    assert got == {"http://a DP engine 0": ["pp0:pcp0:tp0:model.embed_tokens.weight"],
                   "http://a DP engine 1": ["pp0:pcp0:tp0:model.embed_tokens.weight"]}


def test_the_same_version_before_and_after_a_resend() -> None:
    key = "dp0:pp0:pcp0:tp1:model.embed_tokens.weight"
    before = by_engine("http://a", _answer(2, **{key: "wrong"}))
    assert changed(before, by_engine("http://a", _answer(2))) == {
        "http://a DP engine 0": ["pp0:pcp0:tp1:model.embed_tokens.weight"]}
    assert changed(before, before) == {}


def test_a_key_not_in_vllms_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="not 'dp<i>:pp<p>:pcp<c>:tp<t>:<name>'"):
        by_engine("http://a", {"model.embed_tokens.weight": "sha"})
