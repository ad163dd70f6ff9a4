"""The run on disk and its end: the process group, the run dir (made, or found never started), its
checkpoints (what a step saves besides the model and optimizer, and resuming from the latest
complete one), the signals that stop it at a step boundary, and the final HF export.

megatron-core is imported only where a checkpoint or the model is touched: the process group and
the stop helpers also serve torchrun workers and benches that never apply `cpu_compat`."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..config.loader import write_resolved
from ..config.schema import RecipeConfig
from ..megatron.devices import DEFAULT_COLLECTIVE_TIMEOUT_MIN, from_rank0, init_distributed
from ..model_config import InitCheckpoint
from ..weights.map import WeightAdapter
from .rundir import refusal

if TYPE_CHECKING:
    from ..megatron.actor import Actor


class Stop(Exception):
    """The run must stop (reason in the message)."""


def require(value: str | None, what: str) -> str:
    """A recipe value the run cannot do without."""
    if not value:
        raise Stop(f"the recipe must set {what}")
    return value


def init_process_group(timeout_min: float = DEFAULT_COLLECTIVE_TIMEOUT_MIN) -> None:
    """torchrun sets the rendezvous; a plain `python` run is a world of one on loopback."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        # A world of one needs no rendezvous: an in-process store instead of a TCPStore, which
        # would listen unauthenticated on every interface for the whole run; gloo's own pair
        # socket stays on loopback.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        init_distributed(timeout_min, store=dist.HashStore())
        return
    init_distributed(timeout_min)


# ------------------------------------------------------------------------------- the run dir
@dataclass(frozen=True)
class Resumed:
    step: int
    """The step the checkpoint ended."""
    version: int
    """The weight version the servers held: the first sync re-sends the weights under it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Everything the checkpoint recorded besides the model and optimizer (the data orders)."""


@dataclass(frozen=True)
class RunDir:
    """`<output_dir>/<run_name>`: the resolved recipe, metrics, checkpoints, the servers' files."""

    path: Path
    cfg: RecipeConfig

    @classmethod
    def make(cls, cfg: RecipeConfig, resume: bool) -> RunDir:
        """Collective. A fresh run refuses to overwrite an existing run dir."""
        name = cfg.logging.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        run = Path(cfg.logging.output_dir) / name
        # Every rank raises, not rank 0 alone: the others would wait for it at the next collective.
        problem = from_rank0(refusal(cfg, run, resume) if dist.get_rank() == 0 else None)
        if problem and not resume:
            raise FileExistsError(problem)
        if problem:
            raise Stop(problem)
        if dist.get_rank() == 0:
            run.mkdir(parents=True, exist_ok=True)
            write_resolved(cfg, run)
        dist.barrier()
        return cls(run, cfg)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def save(self, actor: Actor, init: InitCheckpoint, step: int, version: int, state: dict[str, Any]) -> Path:
        """Checkpoint step `step` with the data `state` (`TrainData.state`: the orders and the
        steps drawn but not trained) (collective; rank 0 prunes to `checkpoint.keep_last`)."""
        from ..megatron import checkpoint

        extra = {"step": step, "order": state["order"], "version": version, "sft_order": state["sft_order"],
                 "in_flight": state.get("in_flight", []),
                 "py_random": _encode_random_state(), **lora_extra(self.cfg, init.path, init.hf_dir)}
        path = checkpoint.save_checkpoint(actor, self.checkpoints / f"step_{step:08d}", extra)
        if dist.get_rank() == 0:
            checkpoint.prune_checkpoints(self.checkpoints, self.cfg.checkpoint.keep_last)
        dist.barrier()
        return path

    def resume(self, actor: Actor, init: InitCheckpoint) -> Resumed | None:
        """Load the latest complete checkpoint into the actor and Python's RNG (None = none yet);
        the data orders' state comes back in `Resumed.extra`."""
        from ..megatron import checkpoint

        rank0 = dist.get_rank() == 0
        if rank0:
            for stale in checkpoint.remove_partial_checkpoints(self.checkpoints):
                print(f"[resume] removed {stale}: a save that did not finish", flush=True)
        latest = checkpoint.latest_checkpoint(self.checkpoints)
        if latest is None:
            return None
        check_lora_resume(self.cfg, latest, init.path)
        extra = checkpoint.load_checkpoint(actor, latest)
        random.setstate(_decode_random_state(extra["py_random"]))
        if rank0:
            print(f"[resume] from {latest} (step {extra['step']})", flush=True)
        return Resumed(int(extra["step"]), int(extra["version"]), extra)

    def export_hf(self, actor_model: torch.nn.Module, adapter: WeightAdapter, src_hf_dir: str) -> Path:
        """Final HF export into `<run>/hf_export` (collective; rank 0 writes) through the same weight
        map as the sync."""
        from ..megatron.lora import merged_deltas
        from ..weights.hf_io import HFCheckpointWriter
        from ..weights.sharding import gather_hf_layers

        out = self.path / "hf_export"
        writer = HFCheckpointWriter(out) if dist.get_rank() == 0 else None
        # LoRA: W + ΔW (a no-op without adapters). The writer holds views of the parameters until it
        # writes, so it finishes before the base is restored.
        with merged_deltas(actor_model):
            for layer in gather_hf_layers(actor_model, adapter):
                if writer is not None:
                    writer.add_many(layer)
            if writer is not None:
                writer.finish(side_files_from=src_hf_dir)
        dist.barrier()
        return out


def lora_extra(cfg: RecipeConfig, init_path: str, hf_dir: str) -> dict[str, Any]:
    """`extra` entries of a LoRA checkpoint ({} without LoRA)."""
    from ..weights.lora_base import lora_record

    lo = cfg.lora
    return lora_record(lo.rank, lo.alpha, list(lo.targets), init_path, hf_dir) if lo.rank > 0 else {}


def check_lora_resume(cfg: RecipeConfig, checkpoint: Path, init_path: str) -> None:
    """A LoRA checkpoint resumes only onto its own base and adapter shape (checked before loading)."""
    from ..megatron.checkpoint import COMPLETE
    from ..weights.lora_base import check_base

    where = str(checkpoint)
    rec = json.loads((checkpoint / COMPLETE).read_text()).get("extra", {}).get("lora")
    if (rec is None) != (cfg.lora.rank == 0):
        raise ValueError(f"{where}: checkpoint {'has no' if rec is None else 'has'} LoRA adapters, the recipe "
                         f"{'trains' if cfg.lora.rank else 'does not train'} LoRA (lora.rank {cfg.lora.rank})")
    if rec is not None:
        got = (rec["rank"], rec["alpha"], rec["targets"])
        if got != (cfg.lora.rank, cfg.lora.alpha, list(cfg.lora.targets)):
            raise ValueError(f"{where}: adapters are (rank, alpha, targets) {got}, the recipe asks for "
                             f"{(cfg.lora.rank, cfg.lora.alpha, list(cfg.lora.targets))}")
        check_base(rec["base"], init_path, where)


def _encode_random_state() -> str:
    return json.dumps(random.getstate(), default=list)


def _decode_random_state(text: str) -> tuple[Any, ...]:
    version, internal, gauss = json.loads(text)
    return (version, tuple(internal), gauss)


# ------------------------------------------------------------------------------------ stopping
class StopSignals:
    """Records SIGTERM, SIGUSR1 (Slurm's warning before the time limit) and SIGINT instead of
    dying: the loop stops at the next step boundary and checkpoints first."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def install(self) -> StopSignals:
        def handler(signum: int, frame: FrameType | None) -> None:
            self.reason = signal.Signals(signum).name

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, handler)
        return self


def agree_on_stop(reason: str | None) -> str | None:
    """Why the run stops after this step, or None (collective). Signals reach ranks at different
    moments; all ranks must stop (and save) at the same step, or the collective checkpoint hangs:
    MAX-reduce the flag once per step."""
    flag = torch.tensor([1.0 if reason else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not reason:
        return "stop requested on another rank"
    return reason
