"""The run's checkpoints: what a step saves besides the model and optimizer (data order,
weight version, Python's RNG), and resuming from the latest complete one."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..megatron.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    remove_partial_checkpoints,
    save_checkpoint,
)
from . import lora_run


@dataclass(frozen=True)
class Resumed:
    step: int
    """The step the checkpoint ended."""
    version: int
    """The weight version the servers held: the first sync re-sends the weights under it."""


def save(session: Any, step: int, version: int) -> Path:
    """Checkpoint step `step` (collective; rank 0 prunes to `checkpoint.keep_last`)."""
    root = session.run_dir / "checkpoints"
    extra = {"step": step, "order": session.order.state(), "version": version,
             "sft_order": session.sft_order.state() if session.sft_order else None,
             "py_random": _encode_random_state(),
             **lora_run.checkpoint_extra(session.cfg, session.init.path, session.hf_dir)}
    path = save_checkpoint(session.actor, root / f"step_{step:08d}", extra)
    if session.rank0:
        prune_checkpoints(root, session.cfg.checkpoint.keep_last)
    dist.barrier()
    return path


def resume(session: Any) -> Resumed | None:
    """Load the latest complete checkpoint into the actor and the data orders (None = none yet)."""
    if session.rank0:
        for stale in remove_partial_checkpoints(session.run_dir / "checkpoints"):
            print(f"[resume] removed {stale}: a save that did not finish", flush=True)
    latest = latest_checkpoint(session.run_dir / "checkpoints")
    if latest is None:
        return None
    lora_run.check_resume(session.cfg, latest, session.init.path)
    extra = load_checkpoint(session.actor, latest)
    session.order.load(extra["order"])
    if session.sft_order and extra.get("sft_order"):
        session.sft_order.load(extra["sft_order"])
    random.setstate(_decode_random_state(extra["py_random"]))
    if session.rank0:
        print(f"[resume] from {latest} (step {extra['step']})", flush=True)
    return Resumed(int(extra["step"]), int(extra["version"]))


def _encode_random_state() -> str:
    return json.dumps(random.getstate(), default=list)


def _decode_random_state(text: str) -> tuple:
    version, internal, gauss = json.loads(text)
    return (version, tuple(internal), gauss)
