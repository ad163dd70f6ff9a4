"""Everything the loop needs, built once: run dir, actor/reference, server, client, transport."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.loader import write_resolved
from ..config.schema import RecipeConfig
from ..data.prompts import prompt_token_ids
from ..data.schema import DataError, PromptRecord, read_prompts, read_sft
from ..megatron.devices import DEFAULT_COLLECTIVE_TIMEOUT_MIN, init_distributed


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


def make_run_dir(cfg: RecipeConfig, resume: bool) -> Path:
    """`<output_dir>/<run_name>`; a fresh run refuses to overwrite an existing run dir."""
    name = cfg.logging.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run = Path(cfg.logging.output_dir) / name
    if dist.get_rank() == 0:
        if run.exists() and not resume and any(run.iterdir()) and not never_started(run):
            raise FileExistsError(f"run dir {run} exists; pass --resume to continue it or pick another "
                                  "logging.run_name")
        run.mkdir(parents=True, exist_ok=True)
        write_resolved(cfg, run)
    dist.barrier()
    return run


RUN_DIR_ENTRIES = {"recipe.resolved.yaml", "recipe.resolved.yaml.tmp", "rollout", "checkpoints", "tensorboard",
                   "metrics.jsonl", "metrics.jsonl.tmp"}
"""What a run writes into its run dir before (and at) its first step."""


def never_started(run: Path) -> bool:
    """A run dir of a run that failed before its first step: only what a run writes, no metrics,
    no checkpoint. Nothing in it is worth keeping, so it neither blocks a fresh run under the same
    name nor survives the failure. A directory holding anything else is never taken for one."""
    names = {p.name for p in run.iterdir()} if run.is_dir() else set()
    metrics = run / "metrics.jsonl"
    logged = metrics.is_file() and metrics.stat().st_size > 0
    return "recipe.resolved.yaml" in names and names <= RUN_DIR_ENTRIES and not logged \
        and not any((run / "checkpoints").glob("step_*"))


@dataclass
class Prompts:
    records: list[PromptRecord]
    token_ids: list[list[int]]
    dicts: list[dict[str, Any]]


def load_prompts(path: str, tokenizer: Any, max_prompt_length: int, on_malformed: str,
                 prompt: Callable[[PromptRecord], list[dict[str, str]]],
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> Prompts:
    """Prompt records rendered by the task's prompt format (and the recipe's chat-template
    variables); longer than the budget = dropped."""
    records = read_prompts(path, on_malformed=on_malformed)
    if not records:
        raise DataError(f"{path}: no prompt records (empty file, or every line skipped as malformed)")
    kept, ids = [], []
    for r in records:
        tokens = prompt_token_ids(tokenizer, prompt(r), chat_template_kwargs)
        if len(tokens) <= max_prompt_length:
            kept.append(r)
            ids.append(tokens)
    if not kept:
        raise DataError(f"{path}: none of its {len(records)} prompts fits rollout.max_prompt_length="
                        f"{max_prompt_length} (chat template included)")
    dropped = len(records) - len(kept)
    if dropped and dist.get_rank() == 0:
        print(f"[data] {dropped} prompts longer than {max_prompt_length} tokens dropped", flush=True)
    return Prompts(kept, ids, [r.to_dict() for r in kept])


def load_sft_tokens(path: str, tokenizer: Any, on_malformed: str,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> list[list[int]]:
    """Expert sequences (prompt + response + EOS) for CHORD's SFT stream, with the prompt length;
    the prompt rendered as the RL prompts are (same chat-template variables)."""
    eos = require_eos(tokenizer, path)
    out = []
    records = read_sft(path, on_malformed=on_malformed)
    if not records:
        raise DataError(f"{path}: no SFT records (the file has no non-blank line)")
    for r in records:
        prompt = prompt_token_ids(tokenizer, r.messages, chat_template_kwargs)
        response = tokenizer(r.response, add_special_tokens=False)["input_ids"] + [eos]
        out.append([len(prompt)] + prompt + response)
    return out


def require_eos(tokenizer: Any, what: str) -> int:
    """The tokenizer's EOS id: responses end there and SFT sequences get one appended."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"{what}: the tokenizer has no EOS token "
                        "(eos_token in tokenizer_config.json); generations and SFT sequences would never end")
    return int(tokenizer.eos_token_id)


def export_hf(actor_model: torch.nn.Module, adapter: Any, src_hf_dir: str, out_dir: Path) -> None:
    """Final HF export (collective; rank 0 writes) through the same weight map as the sync."""
    from ..megatron.lora import merged_deltas
    from ..weights.hf_io import HFCheckpointWriter
    from ..weights.sharding import gather_hf_layers

    writer = HFCheckpointWriter(out_dir) if dist.get_rank() == 0 else None
    # LoRA: W + ΔW (a no-op without adapters). The writer holds views of the parameters until it
    # writes, so it finishes before the base is restored.
    with merged_deltas(actor_model):
        for layer in gather_hf_layers(actor_model, adapter):
            if writer is not None:
                writer.add_many(layer)
        if writer is not None:
            writer.finish(side_files_from=src_hf_dir)
    dist.barrier()

