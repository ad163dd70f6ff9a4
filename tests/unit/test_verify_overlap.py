"""A sync's verification overlapped with the next rollout (issue 43 item 3): `WeightPublisher.check`
judges it in `learn` after the rollout and before any update, so a failed gate still stops the run
before it trains on samples of the unverified weights. The collective parts (the probe statistics,
the diagnosis) are given; what is tested is where the decision falls."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_rl.megatron import cpu_compat
from megatron_rl.sync import verify as verification
from megatron_rl.sync.diagnose import Diagnosis

cpu_compat.apply()   # as `megatron-rl train` does: the publisher imports the actor's modules
from megatron_rl.train.loop import learn  # noqa: E402
from megatron_rl.train.publisher import PendingCheck, WeightPublisher, overlaps_verification  # noqa: E402
from megatron_rl.train.run import Stop  # noqa: E402

BAD, GOOD = torch.tensor([0.5, 0.9, 1.0, 1.0]), torch.tensor([1e-7, 2e-7, 3e-7, 3e-7])
GATE = verification.Gate((1e-7, 2e-7, 3e-7, 3e-7), verification.Limits(mean=1e-5, p90=5e-5, max=1e-4))


def _publisher(stats: torch.Tensor, pending_version: int | None) -> WeightPublisher:
    publisher = object.__new__(WeightPublisher)
    publisher.rank0, publisher.intact_misses, publisher.gate = True, 0, GATE
    # One server of one DP engine: no /weight_checker comparison to make after a passed gate.
    publisher.cfg = SimpleNamespace(rollout=SimpleNamespace(verify_failures_in_row=3, data_parallel_size=1))
    publisher.fleet = SimpleNamespace(servers=["the server"], supervisors=[])
    publisher.verified = {"sync/verify_max_abs_diff": 1e-7}          # the start-up verification's
    publisher.pending = None if pending_version is None else PendingCheck(pending_version, None)
    publisher._pending_stats = lambda _pending: stats                 # type: ignore[method-assign]
    broken = Diagnosis(sent=10, workers=["w0"], differ={"model.layers.0.mlp.down_proj.weight": {"bytes": ["w0"]}})
    publisher.diagnose = lambda *_a: broken                           # type: ignore[method-assign]
    return publisher


class _Rollouts:
    def take(self, step: int, version: int) -> Any:
        return SimpleNamespace(groups=["samples of version 5"], metrics={}, order={})


def test_a_failed_overlapped_verification_stops_before_any_update() -> None:
    trained: list[Any] = []
    policy = SimpleNamespace(dtype=torch.float32, update=lambda *a: trained.append(a),
                             logprobs=lambda *a: trained.append(a))
    cfg = SimpleNamespace(algorithm=SimpleNamespace(), rollout=SimpleNamespace(max_prompt_length=4,
                                                                              max_response_length=4))
    publisher = _publisher(BAD, 5)
    with pytest.raises(Stop, match="weight-sync verification failed at version 5"):
        learn(cfg, None, None, policy, _Rollouts(), 4, 5, check=publisher.check)  # type: ignore[arg-type]
    assert trained == [] and publisher.pending is None


def test_check_returns_the_verification_of_the_rollouts_weights() -> None:
    policy = SimpleNamespace(dtype=torch.float32)
    publisher = _publisher(GOOD, 6)
    got = publisher.check(policy)      # type: ignore[arg-type]
    assert got == verification.as_metrics(GOOD) and publisher.pending is None
    assert publisher.check(policy) == got            # nothing pending: the latest verification's metrics
    assert _publisher(GOOD, None).check(policy) == {"sync/verify_max_abs_diff": 1e-7}  # type: ignore[arg-type]


@pytest.mark.parametrize("staleness,sleep,dtype,want", [(0, None, torch.float32, True), (1, None, torch.float32, False),
                                                        (0, 1, torch.float32, False),
                                                        (0, None, torch.bfloat16, False)])
def test_overlap_only_where_the_gate_is_absolute_and_the_servers_stay_awake(
        staleness: int, sleep: int | None, dtype: torch.dtype, want: bool) -> None:
    cfg = SimpleNamespace(rollout=SimpleNamespace(max_staleness=staleness, sleep_level=sleep))
    assert overlaps_verification(cfg, dtype) is want      # type: ignore[arg-type]
