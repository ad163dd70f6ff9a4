"""`megatron-rl train --dry-run`: everything about a recipe that can be checked without the model.

The recipe's lint rules (batch and micro-batch splits of the RL and SFT streams over DP, rollout
TP × DP against a node, memory options), the data files (readable, prompts within
`rollout.max_prompt_length` with the run's own tokenizer, enough of them for one step) and the
planner's fit. `check_paths=False` skips what needs files that exist only on the cluster.

It is not under `config/` (beside the lint rules it extends): it runs the planner and the run's
tokenizer, which `config/` may not import; `config/check.py` takes it as the dry run's checks.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .config.rules import Finding, lint
from .config.schema import RecipeConfig


def preflight(cfg: RecipeConfig, check_paths: bool = True, gpu_memory_gb: float = 80.0) -> list[Finding]:
    findings = lint(cfg, check_paths)
    if check_paths and not any(f.rule == "missing-file" for f in findings):
        findings += data_findings(cfg)
    return findings + fit_findings(cfg, gpu_memory_gb) + startup_findings(cfg)


def _error(rule: str, key: str, message: str) -> Finding:
    return Finding("error", rule, key, message)


def _prompt_lengths(cfg: RecipeConfig, records: list[Any], tokenizer: Any) -> list[int]:
    """Each prompt's tokens as the trainer renders it: the task's prompt format, the recipe's
    chat-template variables."""
    from .data.prompts import prompt_token_ids
    from .tasks import load_task_spec
    from .tasks.plugins import PluginError
    from .tasks.task import stored_messages

    try:
        prompt = load_task_spec(cfg.task).prompt
    except PluginError:                 # lint's reward-names has reported it
        prompt = stored_messages
    return [len(prompt_token_ids(tokenizer, prompt(r), cfg.rollout.chat_template_kwargs)) for r in records]


def data_findings(cfg: RecipeConfig) -> list[Finding]:
    """The data files parse, and the training prompts fit `max_prompt_length` (as the trainer
    tokenizes them) in numbers enough for one step."""
    from .data.schema import DataError, read_prompts, read_sft

    d, r = cfg.data, cfg.rollout
    out: list[Finding] = []
    try:
        train = read_prompts(d.train_path, on_malformed=d.on_malformed) if d.train_path else []
        if d.eval_path:
            read_prompts(d.eval_path, on_malformed=d.on_malformed)
        sft = read_sft(d.sft_path, on_malformed=d.on_malformed) \
            if d.sft_path and cfg.algorithm.name == "chord" else []
    except (DataError, OSError) as exc:
        return [_error("data", "data", str(exc))]
    if not d.train_path:
        return [_error("data", "data.train_path", "the trainer needs RL prompts; set data.train_path")]
    from transformers import AutoTokenizer

    from .model_config import ModelConfigError, init_checkpoint

    try:
        tokenizer_dir = cfg.model.tokenizer or init_checkpoint(cfg.model).hf_dir   # the trainer's choice
    except ModelConfigError as exc:
        return [_error("data", "model.init_checkpoint", str(exc))]

    lengths = _prompt_lengths(cfg, train, AutoTokenizer.from_pretrained(tokenizer_dir))
    kept = sum(n <= r.max_prompt_length for n in lengths)
    per_step = cfg.trainer.global_batch_size * cfg.algorithm.steps_per_generation // r.n
    if kept < per_step:
        out.append(_error("data", "data.train_path",
                          f"{kept} of {len(lengths)} prompts fit rollout.max_prompt_length={r.max_prompt_length} "
                          f"tokens (longest {max(lengths, default=0)}); one step needs {per_step}"))
    elif kept < len(lengths):
        out.append(Finding("warning", "data", "data.train_path",
                           f"{len(lengths) - kept} of {len(lengths)} prompts are longer than "
                           f"rollout.max_prompt_length={r.max_prompt_length} tokens and will be dropped"))
    if cfg.algorithm.name == "chord" and len(sft) < cfg.algorithm.chord.sft_batch_size:
        out.append(_error("data", "data.sft_path", f"{len(sft)} expert rows; one step needs "
                          f"algorithm.chord.sft_batch_size={cfg.algorithm.chord.sft_batch_size}"))
    return out


def _gpu_model(cfg: RecipeConfig) -> dict[str, Any] | None:
    """The HF config of a GPU job's model (None: a CPU job, or no config to read; lint reports that)."""
    from .model_config import ModelConfigError, resolve_hf_config

    if cfg.gpus_per_node == 0:
        return None
    try:
        return resolve_hf_config(cfg.model) if not cfg.model.hf_config or Path(cfg.model.hf_config).exists() else None
    except ModelConfigError:
        return None                                  # lint has reported it


def startup_findings(cfg: RecipeConfig) -> list[Finding]:
    """`rollout.startup_timeout_s` against the model's cold start (`planner.timing.cold_start_seconds`):
    the sbatch script and the trainer give up on a server that is still reading its checkpoint."""
    from .planner.params import count_params
    from .planner.timing import COLD_READ_GB_S, ENGINE_START_S, STARTUP_MARGIN, cold_start_seconds

    hf = _gpu_model(cfg)
    if hf is None:
        return []
    params = count_params(hf)
    cold = cold_start_seconds(params, cfg)
    need = STARTUP_MARGIN * cold
    if cfg.rollout.startup_timeout_s >= need:
        return []
    gb = (cold - ENGINE_START_S) * COLD_READ_GB_S
    return [_error("startup-timeout", "rollout.startup_timeout_s",
                   f"{cfg.rollout.startup_timeout_s:.0f} s is less than {STARTUP_MARGIN:.0f} × a cold server start of "
                   f"~{cold:.0f} s ({gb:.0f} GB of {cfg.rollout.dtype} weights per server node at "
                   f"{COLD_READ_GB_S:.0f} GB/s + {ENGINE_START_S:.0f} s of compile and CUDA-graph capture); "
                   f"set it to at least {math.ceil(need / 60) * 60}")]


def fit_findings(cfg: RecipeConfig, gpu_memory_gb: float) -> list[Finding]:
    """The planner's verdict on the recipe's own layout (GPU jobs with a known model only)."""
    from .planner.memory import Hardware
    from .planner.plan import plan
    from .planner.report import render

    hf = _gpu_model(cfg)
    if hf is None:
        return []
    result = plan(cfg, hf, Hardware(cfg.parallelism.gpus_per_node, gpu_memory_gb), limit=0)
    if result.estimate.fits:
        return []
    verdict = next(line for line in render(result).splitlines() if line.startswith("verdict:"))
    return [_error("fit", "parallelism", f"{verdict.removeprefix('verdict: ')} (`megatron-rl plan` "
                   f"shows the terms and layouts that fit)")]
