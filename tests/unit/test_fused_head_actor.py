"""`trainer.fused_lm_head`: the actor's log-probs and optimizer steps with the fused head equal the
output layer's logits path, in one process on real megatron-core (TP 1; TP 2 + SP is a layout of
`tests/mp/layouts_worker.py`). GRPO with an entropy bonus (its gradient goes through the head),
GSPO and CHORD (expert rows in the same forward); the MoE model's untied output layer (weight
gradient straight into DDP's main_grad) and the dense model's tied embeddings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_rl.megatron import cpu_compat

cpu_compat.apply()

from megatron_rl.config.schema import AlgorithmConfig, ChordConfig, ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel, unwrap  # noqa: E402
from megatron_rl.megatron.devices import init_distributed  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from megatron_rl.weights.tiny import build_tiny_hf_checkpoint  # noqa: E402
from tests.helpers.models import DENSE_TIED, TINY_MOE  # noqa: E402
from tests.mp.layouts_worker import make_batch  # noqa: E402

# The layout tests' tolerances (tests/integration/test_megatron_parallel.py): fp32 reduction order.
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-4
LOGPROB_ATOL = 2e-6
OBJECTIVES = {
    "grpo_entropy": AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.28, entropy_coef=0.01, steps_per_generation=2),
    "gspo": AlgorithmConfig(name="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, loss_agg_mode="seq-mean-token-mean",
                            steps_per_generation=2),
    "chord": AlgorithmConfig(name="chord", chord=ChordConfig(mu_peak=0.5, mu_valley=0.5), steps_per_generation=2),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    torch.set_num_threads(1)
    init_distributed(store=dist.HashStore())
    init_parallel(ParallelismConfig(), seed=1234)
    yield {name: build_tiny_hf_checkpoint(fields, tmp_path_factory.mktemp(name), seed=0)
           for name, fields in (("moe", TINY_MOE), ("dense_tied", DENSE_TIED))}
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _steps(hf_dir: Path, objective: str, fused: bool) -> tuple[torch.Tensor, list[float], dict[str, torch.Tensor]]:
    """π_old of the batch, the losses of two optimizer steps and the weights after them."""
    init_parallel(ParallelismConfig(), seed=1234)
    hf = read_hf_config(hf_dir)
    actor = Actor(build_model(hf, ParallelismConfig(), torch.float32), 2,
                  Training(TrainerConfig(lr=1e-3, clip_grad=1.0), ParallelismConfig(), total_updates=10),
                  fused_lm_head=fused)
    assert actor.fused_lm_head is fused
    load_hf_into_model(actor.model, str(hf_dir), weight_map(hf))
    actor.optimizer.reload_model_params()
    batch = make_batch(hf["vocab_size"])
    batch.old_logprobs = actor.compute_logprobs(batch, temperature=0.9)
    batch.ref_logprobs = batch.old_logprobs.clone()
    if objective == "chord":
        sft = make_batch(hf["vocab_size"], rows=2, length=20, seed=11)
        batch.sft_tokens, batch.sft_mask = sft.tokens, sft.mask
    losses = [actor.train_step(batch, OBJECTIVES[objective], temperature=0.9, rl_step=s)["loss/total"]
              for s in range(2)]
    weights = {k: v.detach().clone() for k, v in unwrap(actor.model).state_dict().items() if torch.is_tensor(v)}
    return batch.old_logprobs, losses, weights


@pytest.mark.parametrize("model", ["moe", "dense_tied"])
@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_fused_head_steps_equal_the_logits_path(checkpoints: dict[str, Path], model: str, objective: str) -> None:
    old_f, losses_f, weights_f = _steps(checkpoints[model], objective, fused=True)
    old_u, losses_u, weights_u = _steps(checkpoints[model], objective, fused=False)
    torch.testing.assert_close(old_f, old_u, atol=LOGPROB_ATOL, rtol=0)
    assert losses_f[0] != losses_f[1]                          # the first step changed the policy
    assert losses_f == pytest.approx(losses_u, rel=LOSS_RTOL)
    assert sorted(weights_f) == sorted(weights_u)
    diff = max(float((weights_f[k] - weights_u[k]).abs().max()) for k in weights_u)
    assert diff <= WEIGHT_ATOL, diff
    head = "embedding.word_embeddings.weight" if model == "dense_tied" else "output_layer.weight"
    initial = _initial(checkpoints[model])
    assert float((weights_f[head] - initial[head]).abs().max()) > 1.5e-3   # the head itself was trained


def _initial(hf_dir: Path) -> dict[str, torch.Tensor]:
    init_parallel(ParallelismConfig(), seed=1234)
    hf = read_hf_config(hf_dir)
    actor = Actor(build_model(hf, ParallelismConfig(), torch.float32), 2, None)
    load_hf_into_model(actor.model, str(hf_dir), weight_map(hf))
    return {k: v.detach().clone() for k, v in unwrap(actor.model).state_dict().items()
                        if torch.is_tensor(v)}


def test_frozen_reference_gives_the_logits_path_logprobs(checkpoints: dict[str, Path]) -> None:
    """A frozen reference (no DDP, weight without gradient) gives the logits path's log-probs."""
    hf = read_hf_config(checkpoints["moe"])
    out: list[Any] = []
    for fused in (True, False):
        init_parallel(ParallelismConfig(), seed=1234)
        ref = Actor(build_model(hf, ParallelismConfig(), torch.float32), 2, None, fused_lm_head=fused)
        load_hf_into_model(ref.model, str(checkpoints["moe"]), weight_map(hf))
        out.append(ref.compute_logprobs(make_batch(hf["vocab_size"], rows=3), temperature=1.0))
    torch.testing.assert_close(out[0], out[1], atol=LOGPROB_ATOL, rtol=0)
    assert out[0].shape == (3, 23) and bool((out[0] < 0).all())
