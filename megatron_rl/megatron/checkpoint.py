"""Megatron dist-checkpoints of the actor: model + optimizer + scheduler + step + RNG.

The torch_dist format is layout-independent, so a checkpoint saved at one TP/PP/EP layout loads at
another (Megatron reshards on load). Saves go to `<dir>.partial` and are renamed only after every
rank finished and the `complete` marker is written, so a crash never leaves a directory that
`latest_checkpoint` would pick.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# The actor import applies the CPU patches, which must precede the first megatron.core import.
from .actor import Actor, unwrap  # isort: skip
from .lora import load_part, lora_part  # isort: skip

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories  # noqa: E402

COMPLETE = "complete.json"
PARTIAL = ".partial"


def _sharded_state(actor: Actor, is_loading: bool, with_optimizer: bool = True, base: bool = False) -> dict[str, Any]:
    """With LoRA, a checkpoint is the adapters (+ their optimizer state); `base` = the other part
    (the frozen weights, read from an init checkpoint)."""
    model_sd = unwrap(actor.model).sharded_state_dict()
    if actor.lora is not None:
        model_sd = lora_part(model_sd, adapters=not base)
    state: dict[str, Any] = {"model": model_sd}
    if actor.trainable and with_optimizer:
        # 'fully_reshardable' gathers each parameter's optimizer state, so a checkpoint loads at
        # any TP/PP/EP/DP layout (the default model-space format needs flattened ranges, which
        # megatron's own validator rejects in 0.19).
        state["optimizer"] = actor.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True})
    return state


def _without_view_clones(state: dict[str, Any]) -> dict[str, Any]:
    """Megatron's writer clones every CPU tensor that views a larger storage before it writes
    anything (`FileSystemWriterAsync.prepare_write_data`): each expert fc1's gate and up halves,
    for one. On CPU that is a second copy of those weights held for the whole save: +210 MB on a
    1 GB conversion worker in bench/convert_bench.py. An alias over the same bytes, with a storage of
    its own, is written as it is."""
    apply_factories(state)
    for item in nested_values(state):
        if isinstance(item, ShardedTensor) and isinstance(item.data, torch.Tensor):
            item.data = _own_storage_alias(item.data)
    return state


def _own_storage_alias(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or — for a contiguous CPU view of a larger storage — the same memory as a tensor
    whose storage is exactly its bytes (it keeps the original storage alive)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.nbytes == 0 or t.untyped_storage().nbytes() == t.nbytes:
        return t
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()
    return torch.frombuffer(raw, dtype=t.dtype).view(t.shape)


def _merge_in_place(state: dict[str, Any]) -> dict[str, Any]:
    """On load, a factory's merge rebuilds the tensor from its loaded parts, e.g. each fc1 from its
    gate and up halves with `torch.cat`, and `load_state_dict` then copies that into the parameter:
    every fc1 twice at once (+768 MB loading bench/convert_bench.py's model in one process). The
    parts were loaded in place into views of the parameter the factory was built from; when they
    tile it exactly, the parameter already is the merge (merge is the inverse of build)."""
    for item in nested_values(state):
        if isinstance(item, ShardedTensorFactory) and isinstance(item.data, torch.Tensor):
            item.merge_fn = _reuse_if_tiled(item.data, item.merge_fn)
    return state


def _reuse_if_tiled(data: torch.Tensor, merge: Any) -> Any:
    def merged(loaded: Any) -> Any:
        parts = list(nested_values(loaded)) if isinstance(loaded, (dict, list)) else [loaded]
        if parts and all(_within(p, data) for p in parts) and \
                sum(p.nbytes for p in parts) == data.nbytes:
            return data
        return merge(loaded)
    return merged


def _within(part: Any, data: torch.Tensor) -> bool:
    """`part` is a dense view inside `data`'s memory (parts come from chunks, so they cannot overlap)."""
    if not isinstance(part, torch.Tensor) or not part.is_contiguous() or part.dtype != data.dtype:
        return False
    if part.untyped_storage().data_ptr() != data.untyped_storage().data_ptr() or not data.is_contiguous():
        return False
    return data.data_ptr() <= part.data_ptr() and part.data_ptr() + part.nbytes <= data.data_ptr() + data.nbytes


def save_checkpoint(actor: Actor, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Collective: every rank calls it. `extra` (JSON-able, e.g. data-loader position) rides along."""
    final = Path(directory)
    tmp = final.with_name(final.name + PARTIAL)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _without_view_clones(_sharded_state(actor, is_loading=False))
    need = _state_bytes(state) * dist.get_world_size()     # before the save, which consumes the state
    _write_results_in_process()
    try:
        dist_checkpointing.save(state, str(tmp))
        rng_dir = tmp / "rng"
        rng_dir.mkdir(exist_ok=True)
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                   rng_dir / f"rank{dist.get_rank()}.pt")
        _fsync_tree(tmp)                # durable before the rename makes it the checkpoint
        dist.barrier()
        if dist.get_rank() == 0:
            meta = {"step": actor.step, "world_size": dist.get_world_size(),
                    "optimizer_parts": _optimizer_parts(actor),
                    "scheduler": actor.scheduler.state_dict() if actor.trainable else None, "extra": extra or {}}
            _write_synced(tmp / COMPLETE, json.dumps(meta, indent=1))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(final.parent)
    except BaseException as exc:       # torch's CheckpointException is not an Exception
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)) and _disk_full(exc, tmp.parent, need):
            raise DiskFullError(f"checkpoint {final}: no space left on the device of {tmp.parent} "
                                f"(needs about {need / 2**20:.1f} MiB, "
                                f"{shutil.disk_usage(tmp.parent).free / 2**20:.1f} MiB free); the partial save was "
                                "removed, earlier checkpoints and metrics are intact") from exc
        raise
    dist.barrier()
    return final


def _write_results_in_process() -> None:
    """megatron-core's torch_dist writer returns its write results through a queue that a spawned
    multiprocessing Manager serves, made at the first save, for saves that run in a background
    process. Ours run in the saving process (checkpoint.async_save is refused), so a plain queue
    holds them: no manager process that re-imports the rank's main module (measured here: 3 s of
    CPU per rank, and the first save waited 3-7 s for it)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


class DiskFullError(OSError):
    """A save ran out of disk space (the message names the path and the bytes needed)."""


def _state_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in a sharded state: about what its part of a checkpoint takes."""
    return sum(item.data.nbytes for item in nested_values(state)
               if isinstance(item, ShardedTensor) and isinstance(item.data, torch.Tensor))


def _disk_full(exc: BaseException, where: Path, need: int) -> bool:
    """ENOSPC anywhere in the chain, or a writer's opaque failure ("Worker failure", torch's zip
    writer's "unexpected pos") while less than the save's size is free."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC or "No space left" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(where).free < need
    except OSError:
        return False


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OptimizerLayoutMismatch(RuntimeError):
    """The optimizer state cannot be resharded onto this layout (weights still can)."""


def _optimizer_parts(actor: Actor) -> int:
    """How many optimizers megatron chains (dense / expert params split differently per layout)."""
    return len(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])) if actor.trainable else 0


def load_checkpoint(actor: Actor, directory: str | Path, load_optimizer: bool = True) -> dict[str, Any]:
    """Collective. Restores weights (any layout), optimizer, scheduler, step and — when the world
    size matches — every rank's RNG state. Returns the saved `extra`."""
    path = Path(directory)
    meta_file = path / COMPLETE
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {COMPLETE})")
    meta = json.loads(meta_file.read_text())
    if load_optimizer and actor.trainable and meta.get("optimizer_parts") != _optimizer_parts(actor):
        # Megatron 0.19 keeps per-optimizer common state (param groups, steps) in the structure
        # of the saving layout; a layout that splits dense/expert parameters into a different
        # number of optimizers cannot take it. Weights reshard regardless.
        raise OptimizerLayoutMismatch(
            f"{path}: optimizer state was saved as {meta.get('optimizer_parts')} chained optimizer(s), this "
            f"layout has {_optimizer_parts(actor)}; resume at the saving layout, or load weights only "
            "(load_optimizer=False, fresh Adam state)")
    if load_optimizer and actor.trainable:
        # A fresh optimizer has no Adam state yet; megatron's loader fills existing state in place.
        for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
            opt._init_optimizer_states_with_dummy_values()
    state = _merge_in_place(_sharded_state(actor, is_loading=True, with_optimizer=load_optimizer))
    loaded = dist_checkpointing.load(state, str(path))
    load_part(actor, loaded["model"], adapters=True)
    if load_optimizer and actor.trainable:
        actor.optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(actor)
    elif actor.trainable:
        actor.optimizer.reload_model_params()   # fp32 master weights follow the loaded weights
    if actor.trainable and meta.get("scheduler"):
        actor.scheduler.load_state_dict(meta["scheduler"])
    actor.step = int(meta["step"])
    rng = path / "rng" / f"rank{dist.get_rank()}.pt"
    if meta["world_size"] == dist.get_world_size() and rng.is_file():
        states = torch.load(rng, weights_only=False)
        torch.set_rng_state(states["cpu"])
        if states["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(states["cuda"])
    return meta["extra"]


def _unshare_adam_steps(actor: Actor) -> None:
    """megatron's loader gives every torch.optim.Adam parameter state the *same* `step` tensor;
    Adam increments it in place once per parameter, so bias correction runs away after one step
    (measured: step 34 instead of 2 with 33 parameters). Give each state its own copy."""
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _complete(root: str | Path) -> list[Path]:
    """Complete `step_XXXXXXXX` checkpoints, oldest first (a `.partial` is never one, whatever it holds)."""
    found = [p for p in Path(root).glob("step_*") if not p.name.endswith(PARTIAL) and (p / COMPLETE).is_file()
             and p.name.split("_", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("_", 1)[1]))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete `step_XXXXXXXX` checkpoint under `root`."""
    complete = _complete(root)
    return complete[-1] if complete else None


def remove_partial_checkpoints(root: str | Path) -> list[Path]:
    """Delete `step_*.partial` directories left by saves that died (rank 0, before a resumed run saves)."""
    stale = sorted(Path(root).glob(f"step_*{PARTIAL}"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (rank 0 only)."""
    complete = _complete(root)
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_weights(actor: Actor, directory: str | Path) -> None:
    """Collective. Only the weights of a complete dist-checkpoint (saved at any layout), as a run's
    starting point: step, scheduler, optimizer state and RNG stay those of the fresh actor."""
    path = Path(directory)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {COMPLETE})")
    state = _merge_in_place(_sharded_state(actor, is_loading=True, with_optimizer=False, base=True))
    load_part(actor, dist_checkpointing.load(state, str(path))["model"], adapters=False)
    if actor.trainable:
        actor.optimizer.reload_model_params()   # fp32 master weights follow the loaded weights
