"""torchrun worker: a non-finite loss, or a non-finite gradient under a finite loss, skips the
optimizer update and leaves weights and Adam state untouched; the next finite step updates
normally. Writes a JSON report from rank 0."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.config.schema import AlgorithmConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from layouts_worker import LAYOUTS, make_batch  # noqa: E402

from tests.mp.common import finish  # noqa: E402


def snapshot(actor: Actor) -> list[torch.Tensor]:
    return [p.detach().clone() for p in actor.model.parameters()]


def main() -> None:
    hf_dir, out = sys.argv[1:3]
    init_parallel(LAYOUTS["tp2_sp"], seed=1)
    hf = read_hf_config(hf_dir)
    actor = Actor(build_model(hf, LAYOUTS["tp2_sp"], torch.float32), 2,
                  Training(TrainerConfig(lr=1e-3), LAYOUTS["tp2_sp"], total_updates=5))
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    actor.optimizer.reload_model_params()
    batch = make_batch(hf["vocab_size"])
    batch.old_logprobs = actor.compute_logprobs(batch, 1.0)
    before = snapshot(actor)
    bad = make_batch(hf["vocab_size"])
    bad.old_logprobs = batch.old_logprobs
    bad.advantages = batch.advantages.clone()
    bad.advantages[3] = math.nan
    m_bad = actor.train_step(bad, AlgorithmConfig(), temperature=1.0, rl_step=0)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot(actor)))
    lr_after_bad = m_bad["lr"]
    # A NaN gradient under a finite loss, on one rank only: rank 1 poisons one parameter's
    # gradient as backward computes it. The skip must be agreed by every rank.
    param = next(p for p in actor.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: torch.full_like(g, math.nan)) if dist.get_rank() == 1 else None
    m_grad = actor.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=0)
    if hook is not None:
        hook.remove()
    unchanged_grad = all(torch.equal(a, b) for a, b in zip(before, snapshot(actor)))
    m_good = actor.train_step(batch, AlgorithmConfig(), temperature=1.0, rl_step=0)
    changed = any(not torch.equal(a, b) for a, b in zip(before, snapshot(actor)))
    skipped = torch.tensor([m_grad["update_skipped"]])
    dist.all_reduce(skipped, op=dist.ReduceOp.MIN)       # 1 only if every rank skipped
    finish({"bad_skipped": m_bad["update_skipped"], "bad_loss_finite": math.isfinite(m_bad["loss/total"]),
            "weights_unchanged_after_bad": unchanged, "good_skipped": m_good["update_skipped"],
            "weights_changed_after_good": changed, "lr_after_bad": lr_after_bad,
            "grad_skipped_on_all_ranks": float(skipped), "grad_loss": m_grad["loss/total"],
            "grad_norm_poisoned": m_grad["grad_norm"], "weights_unchanged_after_bad_grad": unchanged_grad,
            "good_grad_norm": m_good["grad_norm"]}, out)


if __name__ == "__main__":
    main()
