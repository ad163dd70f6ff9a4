"""What the rollout server changes in vLLM on CPU (`rollout/server_main.py`): each patch replaces
what it names, fails loudly where upstream moved it, and computes what upstream's code computes."""

from __future__ import annotations

import os

import pytest
import torch


def test_logprob_ranks_are_counted_eagerly_as_upstream_counts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs as upstream

    from megatron_rl.rollout import server_main

    monkeypatch.setattr(sampler, "batched_count_greater_than", upstream.batched_count_greater_than)
    server_main._eager_logprob_ranks()
    patched = sampler.batched_count_greater_than
    server_main._eager_logprob_ranks()      # vLLM's CPU hook runs in the API process and in the engine core
    assert sampler.batched_count_greater_than is patched
    assert patched is not upstream.batched_count_greater_than and not hasattr(patched, "_torchdynamo_orig_callable")
    # Upstream's own body (what torch.compile compiles), run as written.
    body = upstream.batched_count_greater_than._torchdynamo_orig_callable
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 37):                 # the batch sizes whose 0/1 specialisation upstream avoids
        x = torch.randn(rows, 1000, generator=g).log_softmax(-1)
        values = x.gather(-1, torch.randint(0, 1000, (rows, 1), generator=g))
        x[0, :5] = values[0]                # ties count (>=): the token's own rank includes itself
        got = patched(x, values)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert torch.equal(got, body(x, values))
    monkeypatch.delattr(sampler, "batched_count_greater_than")
    with pytest.raises(RuntimeError, match="batched_count_greater_than is gone"):
        server_main._eager_logprob_ranks()


def test_the_cpu_platform_hook_forks_the_engine_and_counts_ranks_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring: vLLM's CPU platform calls its config hook in the API process before it forks the
    engine core (and again in the engine core); ours sets `fork` and patches the rank count there."""
    from vllm.platforms import cpu
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs as upstream

    from megatron_rl.rollout import server_main

    seen: list[object] = []
    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(lambda cls, c: seen.append(c)))
    monkeypatch.setattr(sampler, "batched_count_greater_than", upstream.batched_count_greater_than)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    server_main._fork_engine_processes_on_cpu()
    assert sampler.batched_count_greater_than is upstream.batched_count_greater_than      # not before the hook
    cpu.CpuPlatform.check_and_update_config("config")
    cpu.CpuPlatform.check_and_update_config("config")              # again, as in the forked engine core
    assert seen == ["config", "config"]                                                   # upstream's hook ran
    assert sampler.batched_count_greater_than is not upstream.batched_count_greater_than
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
