"""torchrun worker for tests/integration/test_convert.py: every conversion, parity and failure case in one launch.

`torchrun --nproc-per-node 2 tests/mp/convert_worker.py SPEC_JSON OUT_JSON`. The spec (written by
the test) names the tiny HF checkpoints, the layouts, the HF reference logits and the broken
checkpoints; rank 0 writes what happened to OUT_JSON, and the test asserts on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.convert import worker as cw  # noqa: E402
from megatron_rl.convert.job import ConversionError, ConvertJob, ConvertLayout  # noqa: E402
from megatron_rl.megatron.actor import unwrap  # noqa: E402
from megatron_rl.megatron.checkpoint import load_checkpoint  # noqa: E402
from megatron_rl.model_config import num_experts, read_hf_config  # noqa: E402
from megatron_rl.weights.hf_io import CheckpointError  # noqa: E402
from megatron_rl.weights.stream_io import PlannedHFWriter  # noqa: E402
from tests.mp.common import finish  # noqa: E402


def layout(name: str, hf: dict[str, Any]) -> ConvertLayout:
    moe = num_experts(hf) > 0
    return {"tp1": ConvertLayout(),
            "tp2_ep2": ConvertLayout(tp=2, ep=2 if moe else 1, etp=1 if moe else None),
            "pp2": ConvertLayout(pp=2)}[name]


def convert(direction: str, src: Path, out: Path, lay: ConvertLayout, **kw: Any) -> dict[str, Any]:
    job = ConvertJob(direction, str(src), str(out), lay, progress=False, **kw)
    return (cw.hf_to_mcore if direction == "hf-to-mcore" else cw.mcore_to_hf)(job)


def leftovers(out: Path) -> list[str]:
    """Anything next to `out` that carries its name: the output itself or a temporary directory."""
    return sorted(p.name for p in out.parent.iterdir() if out.name in p.name)


def gathered_logits(hf: dict[str, Any], ckpt: Path, lay: ConvertLayout, tokens: torch.Tensor) -> torch.Tensor:
    """Megatron logits of the converted checkpoint, loaded at `lay`, vocab-parallel parts gathered."""
    from megatron.core import parallel_state as ps

    actor = cw.frozen_model(hf, lay, torch.float32)
    load_checkpoint(actor, ckpt, load_optimizer=False)
    model = unwrap(actor.model).eval()
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def run_case(case: dict[str, Any], work: Path, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    """HF → Megatron at each layout, back to HF at the next one (cyclically); logits of the
    checkpoint written at the first layout, loaded at each parity layout."""
    src = Path(case["hf_dir"])
    hf = read_hf_config(src)
    names = case["layouts"]
    result: dict[str, Any] = {"roundtrip": {}, "parity": {}}
    for first, second in zip(names, names[1:] + names[:1]):
        mc, back = work / f"mc_{first}", work / f"hf_{first}_{second}"
        convert("hf-to-mcore", src, mc, layout(first, hf))
        convert("mcore-to-hf", mc, back, layout(second, hf), max_shard_bytes=case["max_shard_bytes"])
        result["roundtrip"][f"{first}->{second}"] = str(back)
    for name in case["parity_layouts"]:
        logits = gathered_logits(hf, work / f"mc_{names[0]}", layout(name, hf), reference["tokens"])
        result["parity"][name] = (logits - reference["logits"]).abs().max().item()
    return result


def expect_failure(fn: Any, out: Path) -> dict[str, Any]:
    try:
        fn()
    except (ConversionError, CheckpointError, RuntimeError) as exc:
        return {"type": type(exc).__name__, "message": str(exc), "problems": getattr(exc, "problems", []),
                "left": leftovers(out)}
    return {"type": None, "left": leftovers(out)}


def interrupted_export(mc: Path, out: Path, after: int) -> None:
    """mcore-to-hf that dies after `after` tensors, the way a kill or a full disk would."""
    original = PlannedHFWriter.add
    calls = {"n": 0}

    def add(self: PlannedHFWriter, name: str, tensor: torch.Tensor) -> None:
        calls["n"] += 1
        if calls["n"] > after:
            raise RuntimeError("simulated interruption")
        original(self, name, tensor)

    PlannedHFWriter.add = add
    try:
        convert("mcore-to-hf", mc, out, ConvertLayout(), max_shard_bytes=100_000)
    finally:
        PlannedHFWriter.add = original


def run_failures(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, bad in spec["broken"].items():
        dst = work / f"broken_{kind}"
        out[kind] = expect_failure(
            lambda bad=bad, dst=dst: convert("hf-to-mcore", Path(bad), dst, ConvertLayout(tp=2)), dst)
    mc = Path(spec["cases"][spec["export_case"]]["work"]) / f"mc_{spec['cases'][spec['export_case']]['layouts'][0]}"
    dst = work / "interrupted_export"
    out["interrupted_export"] = expect_failure(lambda: interrupted_export(mc, dst, after=5), dst)
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    reference = torch.load(spec["reference"])
    result: dict[str, Any] = {"cases": {}}
    for name, case in spec["cases"].items():
        work = Path(case["work"])
        result["cases"][name] = run_case(case, work, reference[name])
    result["failures"] = run_failures(spec, Path(spec["work"]))
    finish(result, sys.argv[2])


if __name__ == "__main__":
    main()
