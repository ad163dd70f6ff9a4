"""torchrun worker for tests/integration/test_released_checkpoints.py (4 gloo processes).

`torchrun --nproc-per-node 4 tests/mp/released_worker.py SPEC_JSON OUT_JSON`. Per case of the spec:
- round trips: hf-to-mcore at one layout, mcore-to-hf at the next (cyclically);
- logits: the HF checkpoint loaded through `load_hf_into_model` (the trainer's start path) at each
  parity layout, full-vocabulary logits through megatron's pipeline schedule, max |Δ| against HF's.
Rank 0 writes what happened to OUT_JSON; the test asserts on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from megatron_rl.config.schema import ParallelismConfig  # noqa: E402
from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region  # noqa: E402

from megatron_rl.convert import worker as cw  # noqa: E402
from megatron_rl.convert.job import ConvertJob, ConvertLayout  # noqa: E402
from megatron_rl.megatron.actor import Actor, init_parallel  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.types import TrainBatch  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from tests.mp.common import finish  # noqa: E402

LAYOUTS = {
    "tp1": dict(),
    "pp2": dict(pp=2),
    "tp2": dict(tp=2),
    "tp2_pp2": dict(tp=2, pp=2),
    "tp2_pp2_ep2": dict(tp=2, pp=2, ep=2, etp=1),
}


def parallel(name: str) -> ParallelismConfig:
    lay = LAYOUTS[name]
    tp = lay.get("tp", 1)
    return ParallelismConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=lay.get("pp", 1),
                             expert_model_parallel_size=lay.get("ep", 1), expert_tensor_parallel_size=lay.get("etp"),
                             sequence_parallel=tp > 1)


def convert(direction: str, src: Path, out: Path, name: str) -> dict[str, Any]:
    job = ConvertJob(direction, str(src), str(out), ConvertLayout(**LAYOUTS[name]), progress=False,
                     max_shard_bytes=200_000)
    return (cw.hf_to_mcore if direction == "hf-to-mcore" else cw.mcore_to_hf)(job)


def pipeline_logits(actor: Actor, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits on the last pipeline stage (None elsewhere), through megatron's
    schedule: the path training and log-prob computation take at PP > 1."""
    def loss_for(mb: TrainBatch, toks: torch.Tensor, logits: torch.Tensor) -> tuple[Any, ...]:
        full = gather_from_tensor_model_parallel_region(logits)
        return logits.sum() * 0.0, torch.tensor(1), {"logits": full.detach()}

    batch = TrainBatch(tokens, torch.zeros(tokens.shape[0], tokens.shape[1] - 1), torch.zeros(tokens.shape[0]))
    actor.model.eval()
    actor.fused_lm_head = False  # the logits themselves are compared with transformers'
    with torch.no_grad():
        reports = actor._run([batch], loss_for, forward_only=True, temperature=1.0, with_entropy=False)
    return reports[0]["logits"] if ps.is_pipeline_last_stage() else None


def parity(hf_dir: Path, name: str, ref: dict[str, torch.Tensor]) -> float:
    """Max |Δ| between HF's logits and megatron's, loaded from HF through the trainer's path."""
    layout = parallel(name)
    init_parallel(layout, seed=5)     # a different seed from the convert's: random init differs
    hf = read_hf_config(hf_dir)
    actor = Actor(build_model(hf, layout, torch.float32), 2, None)
    load_hf_into_model(actor.model, hf_dir, weight_map(hf))
    logits = pipeline_logits(actor, ref["tokens"])
    diff = None if logits is None else (logits - ref["logits"]).abs().max().item()
    diffs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, diff)
    return max(d for d in diffs if d is not None)


def run_case(case: dict[str, Any], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    src, work = Path(case["hf_dir"]), Path(case["work"])
    names = case["layouts"]
    out: dict[str, Any] = {"roundtrip": {}, "dropped": {}, "parity": {}}
    for first, second in zip(names, names[1:] + names[:1]):
        mc, back = work / f"mc_{first}", work / f"hf_{first}_{second}"
        out["dropped"][first] = convert("hf-to-mcore", src, mc, first)["dropped"]
        convert("mcore-to-hf", mc, back, second)
        out["roundtrip"][f"{first}->{second}"] = str(back)
    for name in case["parity_layouts"]:
        out["parity"][name] = parity(src, name, ref)
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = {name: run_case(case, torch.load(case["reference"])) for name, case in spec["cases"].items()}
    finish(result, sys.argv[2])


if __name__ == "__main__":
    main()
