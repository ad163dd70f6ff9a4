"""Everything the loop needs, built once: run dir, actor/reference, server, client, transport."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.loader import write_resolved
from ..config.schema import RecipeConfig
from ..data.schema import PromptRecord, SFTRecord, read_prompts, read_sft
from ..megatron.devices import DEFAULT_COLLECTIVE_TIMEOUT_MIN, init_distributed
from ..objectives import ObjectiveConfig


def init_process_group(timeout_min: float = DEFAULT_COLLECTIVE_TIMEOUT_MIN) -> None:
    """torchrun sets the rendezvous; a plain `python` run is a world of one on loopback."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        from ..rollout.server import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port("127.0.0.1")))
    init_distributed(timeout_min)


def make_run_dir(cfg: RecipeConfig, resume: bool) -> Path:
    """`<output_dir>/<run_name>`; a fresh run refuses to overwrite an existing run dir."""
    name = cfg.logging.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run = Path(cfg.logging.output_dir) / name
    if dist.get_rank() == 0:
        if run.exists() and not resume and any(run.iterdir()):
            raise FileExistsError(f"run dir {run} exists; pass --resume to continue it or pick another "
                                  "logging.run_name")
        run.mkdir(parents=True, exist_ok=True)
        write_resolved(cfg, run)
    dist.barrier()
    return run


def objective_config(cfg: RecipeConfig) -> ObjectiveConfig:
    a = cfg.algorithm
    return ObjectiveConfig(
        clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, dual_clip_c=a.dual_clip_c,
        loss_agg_mode=a.loss_agg_mode, kl_beta=0.0 if a.kl_in_reward else a.kl_beta,
        kl_estimator=a.kl_estimator, kl_clamp=a.kl_clamp, entropy_coef=a.entropy_coef,
        correction_mode=a.correction.mode, correction_cap=a.correction.cap,
        correction_threshold=a.correction.threshold, mu_peak=a.chord.mu_peak, mu_valley=a.chord.mu_valley,
        mu_warmup_steps=a.chord.mu_warmup_steps, mu_decay_steps=a.chord.mu_decay_steps,
        chord_phi=a.chord.phi, rl_objective=a.chord.rl_objective,
    )


@dataclass
class Prompts:
    records: list[PromptRecord]
    token_ids: list[list[int]]
    dicts: list[dict[str, Any]]


def load_prompts(path: str, tokenizer: Any, max_prompt_length: int, on_malformed: str) -> Prompts:
    records = read_prompts(path, on_malformed=on_malformed)
    kept, ids = [], []
    for r in records:
        tokens = list(tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
        if len(tokens) <= max_prompt_length:
            kept.append(r)
            ids.append(tokens)
    if not kept:
        raise ValueError(f"{path}: no prompt fits rollout.max_prompt_length={max_prompt_length}")
    dropped = len(records) - len(kept)
    if dropped and dist.get_rank() == 0:
        print(f"[data] {dropped} prompts longer than {max_prompt_length} tokens dropped", flush=True)
    return Prompts(kept, ids, [r.to_dict() for r in kept])


def load_sft_tokens(path: str, tokenizer: Any, on_malformed: str) -> list[list[int]]:
    """Expert sequences (prompt + response + EOS) for CHORD's SFT stream, with the prompt length."""
    out = []
    for r in read_sft(path, on_malformed=on_malformed):
        prompt = list(tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
        response = tokenizer(r.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append([len(prompt)] + prompt + response)
    return out


def export_hf(actor_model: torch.nn.Module, adapter: Any, src_hf_dir: str, out_dir: Path) -> None:
    """Final HF export (collective; rank 0 writes) through the same weight map as the sync."""
    from ..weights.hf_io import HFCheckpointWriter
    from ..weights.sharding import gather_hf_layers

    writer = HFCheckpointWriter(out_dir) if dist.get_rank() == 0 else None
    for layer in gather_hf_layers(actor_model, adapter):
        if writer is not None:
            writer.add_many(layer)
    if writer is not None:
        writer.finish(side_files_from=src_hf_dir)
    dist.barrier()

