"""The collective side of checkpoint conversion: run by every `torchrun` worker `launcher.py` starts.

hf-to-mcore: each rank builds its shard of the model, checks every name and shape against the HF
headers (all ranks' findings gathered into one error), then fills its parameters one tensor at a
time — each rank reads only the HF tensors its own parameters are made of — and all ranks write one
torch_dist checkpoint with `save_checkpoint`. The HF config, tokenizer files and the HF dtype of
every tensor go to `<out>/hf/`, so mcore-to-hf restores the original checkpoint bit for bit.

mcore-to-hf: each rank loads its shard with `load_checkpoint`, the global tensor list is planned on
rank 0 (names, shapes, dtypes → shard files and headers written up front) and `gather_to_rank0`
streams one layer at a time into `PlannedHFWriter`.

`hf_to_mcore` / `mcore_to_hf` need an initialised process group (torchrun, or a test worker) and
may be called several times in one process.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.schema import LoraConfig, ParallelismConfig
from ..megatron.actor import Actor, init_parallel
from ..megatron.checkpoint import COMPLETE, load_checkpoint, save_checkpoint
from ..megatron.lora import merged_deltas
from ..model_config import ModelConfigError, read_hf_config
from ..models import build_model, weight_map
from ..weights.hf_io import SIDE_FILES, CheckpointError, HFCheckpointReader
from ..weights.lora_base import load_recorded_base, lora_config
from ..weights.map import Entry, WeightAdapter
from ..weights.progress import ByteProgress
from ..weights.sharding import LocalParam, gather_hf_layers, load_full_tensors, local_params
from ..weights.stream_io import PlannedHFWriter, TensorInfo, checkpoint_tensor_infos, lossless_dtype
from .job import HF_TO_MCORE, ConversionError, ConvertJob, ConvertLayout, stats_payload, write_error

HF_SUBDIR = "hf"
WEIGHT_DTYPES = "weight_dtypes.json"
DROPPED = "dropped_tensors.json"
"""In `<out>/hf/`: the HF tensors hf-to-mcore did not convert (the adapter's `ignored_hf_prefixes`)."""
_EXPECTED_ERRORS = (ConversionError, CheckpointError, ModelConfigError, FileNotFoundError)


# ---------------------------------------------------------------------------------------- model
def parallel_layout(layout: ConvertLayout) -> ParallelismConfig:
    # MoE with TP needs sequence parallelism in Megatron; it changes activations, not weights.
    return ParallelismConfig(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                             expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
                             sequence_parallel=layout.tp > 1)


def frozen_model(hf: dict[str, Any], layout: ConvertLayout, dtype: torch.dtype,
                 lora: LoraConfig | None = None) -> Actor:
    """This rank's shard of the model, without optimizer and without random initialisation."""
    pl = parallel_layout(layout)
    try:
        init_parallel(pl, seed=0)
        recipe = build_model(hf, pl, dtype)
    except (ValueError, AssertionError, RuntimeError) as exc:   # e.g. heads not divisible by TP
        world = dist.get_world_size() if dist.is_initialized() else "?"
        raise ConversionError(f"cannot build the model at {layout} on {world} worker(s): {exc}") from exc
    recipe.config.perform_initialization = False     # every weight is overwritten: skip the RNG work
    return Actor(recipe, 1, None, lora=lora)


def full_shape(p: LocalParam) -> tuple[int, ...]:
    shape = list(p.param.shape)
    if p.tp_dim is not None:
        shape[p.tp_dim] *= p.tp_size
    return tuple(shape)


def hf_shapes(adapter: WeightAdapter, entry: Entry, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The HF tensors an unsharded Megatron tensor of `shape` splits into (computed on `meta`)."""
    return {name: tuple(t.shape) for name, t in adapter.to_hf(entry, torch.empty(shape, device="meta"))}


def _all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def model_tensors(adapter: WeightAdapter, params: list[LocalParam]) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Collective: full shape of every global Megatron tensor of the model, and the ones the
    weight map does not know (each rank only sees its own shard)."""
    known = {e.mcore for e in adapter.entries}
    mine = {p.global_name: full_shape(p) for p in params}
    unmapped = sorted({p.global_name for p in params} - known)
    shapes: dict[str, tuple[int, ...]] = {}
    names: set[str] = set()
    for part_shapes, part_unmapped in _all_gather((mine, unmapped)):
        shapes.update(part_shapes)
        names.update(part_unmapped)
    return shapes, sorted(names)


def map_problems(adapter: WeightAdapter, shapes: dict[str, tuple[int, ...]], unmapped: list[str]) -> list[str]:
    """Model ↔ weight map disagreements (a bug in a provider or adapter, not in the checkpoint)."""
    problems = [f"model tensor {n} has no entry in the weight map" for n in unmapped]
    problems += [f"weight map names {e.mcore}, which the model does not have"
                 for e in adapter.entries if e.mcore not in shapes]
    return problems


def hf_problems(adapter: WeightAdapter, shapes: dict[str, tuple[int, ...]],
                found: dict[str, TensorInfo]) -> list[str]:
    """Missing, unexpected and mis-shaped HF tensors (pure; the inputs are already global)."""
    expected: dict[str, tuple[int, ...]] = {}
    for e in adapter.entries:
        if e.mcore in shapes:
            expected.update(hf_shapes(adapter, e, shapes[e.mcore]))
    problems = [f"missing: {n} (expected shape {list(s)})" for n, s in expected.items() if n not in found]
    problems += [f"unexpected: {n} (shape {list(t.shape)}, {t.dtype})" for n, t in found.items()
                 if n not in expected and adapter.entry_for_hf(n) is None and not adapter.is_ignored_hf(n)]
    problems += [f"wrong shape: {n}: checkpoint has {list(found[n].shape)}, model expects {list(s)}"
                 for n, s in expected.items() if n in found and found[n].shape != s]
    return problems


# ------------------------------------------------------------------------------------ hf → mcore
def hf_to_mcore(job: ConvertJob) -> dict[str, Any]:
    """Collective. Writes `job.out` (a complete dist-checkpoint) or raises, leaving nothing."""
    start = time.perf_counter()
    src, out = Path(job.src), Path(job.out)
    hf = read_hf_config(src)
    adapter = weight_map(hf)
    reader = HFCheckpointReader(src)
    try:
        found = checkpoint_tensor_infos(reader)
        dtype = _dtype(job.dtype) or lossless_dtype({t.dtype for t in found.values()})
        actor = frozen_model(hf, job.layout, dtype)
        params = local_params(actor.model)
        shapes, unmapped = model_tensors(adapter, params)
        problems = map_problems(adapter, shapes, unmapped) + hf_problems(adapter, shapes, found)
        if problems:
            raise ConversionError(f"{src} does not match the {hf['architectures'][0]} model "
                                  f"({len(problems)} problem(s)); nothing was written:", problems)
        dropped = sorted(n for n in found if adapter.is_ignored_hf(n))
        if dropped and dist.get_rank() == 0:
            print(f"not converted ({len(dropped)} tensors, {sum(found[n].nbytes for n in dropped) / 2**20:.1f} MiB; "
                  f"no such layer in the Megatron model, listed in {HF_SUBDIR}/{DROPPED}): "
                  f"{', '.join(dropped[:8])}{', ...' if len(dropped) > 8 else ''}", flush=True)
        stage = out.with_name(f".{out.name}.converting")
        try:
            read_bytes, load_s = _load_agreed(actor, adapter, reader, found, job.progress)
            save_start = time.perf_counter()
            _say(job, f"saving torch_dist checkpoint ({dist.get_world_size()} rank(s)) ...")
            extra = {"hf_config": hf, "converted_from": str(src.resolve()), "params_dtype": _name(dtype),
                     "conversion_layout": asdict(job.layout)}
            save_checkpoint(actor, stage, extra=extra)
            if dist.get_rank() == 0:
                _publish(stage, out, src, found, dropped)
            dist.barrier()
        except BaseException:
            _remove_stage(stage)
            raise
    finally:
        reader.close()
    return {"direction": HF_TO_MCORE, "bytes": sum(t.nbytes for t in found.values()), "dropped": dropped,
            "rank0_read_bytes": read_bytes, "load_seconds": load_s,
            "save_seconds": time.perf_counter() - save_start, "seconds": time.perf_counter() - start}


def _load_agreed(actor: Actor, adapter: WeightAdapter, reader: HFCheckpointReader,
                 found: dict[str, TensorInfo], progress: bool) -> tuple[int, float]:
    """Fill this rank's parameters; if any rank failed (e.g. a truncated shard), all raise."""
    error: Exception | None = None
    result = (0, 0.0)
    try:
        result = _load_streaming(actor, adapter, reader, found, progress)
    except Exception as exc:        # re-raised by _agree, once the other ranks know
        error = exc
    _agree(error, "reading the HF checkpoint")
    return result


def _agree(error: Exception | None, what: str) -> None:
    """Collective: raise on every rank if any rank failed, so no rank waits in a collective for a
    rank that gave up (the conversion functions may run inside a longer-lived process)."""
    failures = [m for m in _all_gather(None if error is None else f"rank {dist.get_rank()}: {error}") if m]
    if error is not None:
        raise error
    if failures:
        raise ConversionError(f"another worker failed while {what}:", failures)


def _load_streaming(actor: Actor, adapter: WeightAdapter, reader: HFCheckpointReader,
                    found: dict[str, TensorInfo], progress: bool) -> tuple[int, float]:
    total = sum(found[n].nbytes for p in local_params(actor.model)
                for n in adapter.entry_for_mcore(p.global_name).hf)
    bar = ByteProgress("reading HF tensors (rank 0)", total, sys.stdout, progress and dist.get_rank() == 0)
    layer: list[int | None] = [None]

    def full(name: str) -> torch.Tensor:
        entry = adapter.entry_for_mcore(name)
        if entry.layer != layer[0]:
            # safetensors memory-maps the shards; pages read stay resident (and count as this
            # process's RSS) until the file is closed. Closing per layer bounds that to one layer.
            reader.close()
            layer[0] = entry.layer
        tensors = {n: _read(reader, n) for n in entry.hf}
        bar.update(sum(found[n].nbytes for n in entry.hf))
        return adapter.to_mcore(entry, tensors)

    load_full_tensors(actor.model, full)
    reader.close()              # unmap the last layer's pages before the save needs memory
    return total, bar.close()


def _read(reader: HFCheckpointReader, name: str) -> torch.Tensor:
    try:
        return reader.get(name)
    except CheckpointError:
        raise
    except Exception as exc:    # safetensors' own errors (truncated or corrupt shard) name no file
        raise CheckpointError(f"{reader.dir / reader.weight_map[name]}: cannot read {name}: {exc}") from exc


def _publish(stage: Path, out: Path, src: Path, found: dict[str, TensorInfo], dropped: list[str]) -> None:
    """Rank 0: add the HF side files to the finished stage and move it to `out` in one rename."""
    side = stage / HF_SUBDIR
    side.mkdir()
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, side / name)
    (side / WEIGHT_DTYPES).write_text(json.dumps({n: _name(t.dtype) for n, t in found.items()}, indent=0))
    (side / DROPPED).write_text(json.dumps(dropped, indent=0))
    if out.exists():
        shutil.rmtree(out)
    stage.rename(out)


def _remove_stage(stage: Path) -> None:
    if dist.is_initialized() and dist.get_rank() == 0:
        for path in (stage, stage.with_name(stage.name + ".partial")):
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------ mcore → hf
def mcore_to_hf(job: ConvertJob) -> dict[str, Any]:
    """Collective. Writes `job.out` (an HF checkpoint) on rank 0 or raises, leaving nothing."""
    start = time.perf_counter()
    src, out = Path(job.src), Path(job.out)
    extra = json.loads((src / COMPLETE).read_text()).get("extra", {})
    side = src / HF_SUBDIR
    hf = _recorded_hf_config(job, side, extra)
    adapter = weight_map(hf)
    recorded = json.loads((side / WEIGHT_DTYPES).read_text()) if (side / WEIGHT_DTYPES).is_file() else {}
    params_dtype = (_dtype(extra.get("params_dtype")) or _dtype(hf.get("dtype") or hf.get("torch_dtype"))
                    or torch.float32)
    lora = extra.get("lora")    # a LoRA checkpoint: adapters only, merged into their base below
    actor = frozen_model(hf, job.layout, params_dtype, lora_config(lora))
    if lora is not None:
        load_recorded_base(actor, lora, str(src), adapter)
    load_checkpoint(actor, src, load_optimizer=False)
    load_s = time.perf_counter() - start
    shapes, unmapped = model_tensors(adapter, local_params(actor.model))
    problems = map_problems(adapter, shapes, unmapped)
    if problems:
        raise ConversionError(f"{src}: the model and the weight map disagree ({len(problems)} problem(s)); "
                              "nothing was written:", problems)
    forced = _dtype(job.dtype)
    plan = write_plan(adapter, shapes, lambda n: forced or _dtype(recorded.get(n)) or params_dtype)
    if forced is not None:
        hf = {**hf, **{k: job.dtype for k in ("dtype", "torch_dtype") if k in hf}}
    config = hf if (job.hf_config or forced is not None or not side.is_dir()) else None
    with merged_deltas(actor.model) if lora is not None else nullcontext():
        write_s = _stream_to_hf(actor, adapter, plan, out, job, side if side.is_dir() else None, config)
    return {"direction": "mcore-to-hf", "bytes": sum(t.nbytes for t in plan), "load_seconds": load_s,
            "write_seconds": write_s, "seconds": time.perf_counter() - start}


def _recorded_hf_config(job: ConvertJob, side: Path, extra: dict[str, Any]) -> dict[str, Any]:
    if job.hf_config:
        return read_hf_config(job.hf_config)
    if (side / "config.json").is_file():
        return read_hf_config(side)
    if extra.get("hf_config"):
        return dict(extra["hf_config"])
    raise ConversionError(f"{job.src} records no HF config (not written by hf-to-mcore); pass --hf-config")


def write_plan(adapter: WeightAdapter, shapes: dict[str, tuple[int, ...]],
               dtype_of: Callable[[str], torch.dtype]) -> list[TensorInfo]:
    """Every HF tensor in stream order (the order `gather_to_rank0` delivers layers)."""
    plan = []
    for layer in adapter.layers():
        for e in adapter.entries:
            if e.layer == layer and e.mcore in shapes:
                plan += [TensorInfo(n, s, dtype_of(n)) for n, s in hf_shapes(adapter, e, shapes[e.mcore]).items()]
    return plan


def _stream_to_hf(actor: Actor, adapter: WeightAdapter, plan: list[TensorInfo], out: Path, job: ConvertJob,
                  side: Path | None, config: dict[str, Any] | None) -> float:
    """One layer at a time onto rank 0's writer. A write error stops the writing but not the
    gathers (every rank keeps meeting rank 0 in them); then all ranks raise together."""
    rank0 = dist.get_rank() == 0
    writer = PlannedHFWriter(out, plan, job.max_shard_bytes) if rank0 else None
    dtypes = {t.name: t.dtype for t in plan}
    bar = ByteProgress("writing HF shards", sum(t.nbytes for t in plan), sys.stdout, job.progress and rank0)
    error: Exception | None = None
    try:
        for layer in gather_hf_layers(actor.model, adapter):
            if writer is None or error is not None:
                continue
            try:
                for name, piece in layer:
                    writer.add(name, piece.to(dtypes[name]))
                    bar.update(piece.numel() * dtypes[name].itemsize)
            except Exception as exc:    # re-raised by _agree below
                error = exc
        if writer is not None and error is None:
            try:
                writer.finish(side_files_from=side, config=config)
            except Exception as exc:
                error = exc
    except BaseException:               # interrupted: leave no temporary directory behind
        if writer is not None:
            writer.abort()
        raise
    if writer is not None and error is not None:
        writer.abort()
    _agree(error, "writing the HF checkpoint")
    return bar.close()


# ---------------------------------------------------------------------------------------- utils
def _dtype(name: str | None) -> torch.dtype | None:
    if not name:
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConversionError(f"unknown dtype {name!r}")
    return dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _say(job: ConvertJob, text: str) -> None:
    if job.progress and dist.get_rank() == 0:
        print(text, flush=True)


def _peak_rss() -> int:
    """This process's peak resident set in bytes (Linux reports KiB). Children are not counted:
    their ru_maxrss includes the parent's pages at fork time and would overstate them."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str]) -> int:
    job = ConvertJob.from_json(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    try:
        stats = (hf_to_mcore if job.direction == HF_TO_MCORE else mcore_to_hf)(job)
        rss = _all_gather(_peak_rss())
    except _EXPECTED_ERRORS as exc:
        write_error(job, rank, str(exc))
        return 1
    except Exception:
        write_error(job, rank, f"rank {rank} failed:\n{traceback.format_exc()}")
        return 1
    if rank == 0:
        stats.update(world_size=dist.get_world_size(), peak_rss_per_rank=rss)
        print(f"done: {job.out} ({stats['bytes'] / 2**20:.1f} MiB in {stats['seconds']:.1f} s in the workers)",
              flush=True)
        if job.stats_file:
            Path(job.stats_file).write_text(stats_payload(stats))
    dist.destroy_process_group()
    return 0

