"""Published RL runs with measured step times, expressed as recipes for the time model.

NeMo-RL v0.6.0, docs/about/performance-summary.md ("H100 BF16 Benchmarks", on-policy GRPO, DGX-H100,
Megatron-core training, vLLM generation), with the layouts of its performance recipes
(examples/configs/recipes/llm/performance/grpo-qwen3-{235b-16n8g,30ba3b-4n8g}.yaml over
examples/configs/grpo_math_1B.yaml, tag v0.6.0):

| run | GPUs | prompts × n | T-GBS | max seq | mean seq | gen | train TP,CP,EP,PP | tok/s/GPU | s/step |
|---|---|---|---|---|---|---|---|---|---|
| Qwen3-235B-A22B | 128 | 16 × 32 | 512 | 8192 | 5,698 | TP 16 | 2, 2, 16, 8 | 58.9 | 395 |
| Qwen3-30B-A3B | 32 | 64 × 32 | 512 | 4096 | 3,203 | TP 2 | 1, 1, 8, 1 | 1,102 | 192 |

Both are colocated (vLLM at `gpu_memory_utilization` 0.6 on every GPU, asleep while the policy
trains), compute π_old and π_ref (KL 0.01), pack sequences into micro-batches of one max-length
sequence's tokens, and the 235B run recomputes activations. What our trainer or servers would
refuse is modelled anyway and listed in `modelled`: context parallelism, a pipeline of 8 stages over
94 layers (NeMo-RL: 11 + 6 × 12 + 11), vLLM engines of TP 16 across two nodes. The weight transfer
is `nccl` (NeMo-RL's refit is GPU to GPU too).

Other rows of the same page, predicted with the same constants and not asserted (they were looked
at after the constants were set; GB200 has no row of its own here, so the B200 row with 4 GPUs
per node and 186 GB stands in, and its 72-GPU NVLink domain is treated as InfiniBand):
Qwen3-235B-A22B on 256 H100: 284 s vs 312 s (−9 %), 40.3 vs 37.4 tokens/s/GPU; on 64 GB200:
299 s vs 286 s (+4 %); on 128 GB200: 248 s vs 345 s (−28 %; the published run is slower than the
64-GPU one); Qwen3-30B-A3B on 16 GB200: 150 s vs 221 s (−32 %).

Prompt length: OpenMathInstruct-2 problems in NeMo-RL's `cot.txt` template; the summary gives only
prompt + response (the "G-Average Seq len"). PROMPT_TOKENS is a round estimate of the template
(~40 tokens) plus a problem (~100); the prediction moves by well under 1 % per 50 tokens of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import (
    AlgorithmConfig,
    ModelConfig,
    ParallelismConfig,
    RecipeConfig,
    RolloutConfig,
    TrainerConfig,
)

MODELS = Path(__file__).resolve().parents[2] / "recipes" / "models"
PROMPT_TOKENS = 150


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    cfg: RecipeConfig
    hf: dict[str, Any]
    mean_sequence_tokens: float
    step_seconds: float
    tokens_per_s_per_gpu: float
    modelled: tuple[str, ...]

    @property
    def response_tokens(self) -> float:
        return self.mean_sequence_tokens - PROMPT_TOKENS


def _model(folder: str) -> dict[str, Any]:
    return dict(json.loads((MODELS / folder / "config.json").read_text()))


def _recipe(name: str, hf: dict[str, Any], max_seq: int, parallelism: ParallelismConfig, rollout: dict[str, Any],
            trainer: TrainerConfig, spg: int) -> RecipeConfig:
    rollout_cfg = RolloutConfig(n=32, placement="colocated", max_prompt_length=PROMPT_TOKENS,
                                max_response_length=max_seq - PROMPT_TOKENS, gpu_memory_utilization=0.6,
                                sleep_level=1, weight_transfer="nccl", dtype="bfloat16", max_concurrency=1024,
                                **rollout)
    return RecipeConfig(name=name, model=ModelConfig(tiny=hf, params_dtype="bf16", reference="init"),
                        parallelism=parallelism, rollout=rollout_cfg, trainer=trainer,
                        algorithm=AlgorithmConfig(kl_beta=0.01, steps_per_generation=spg))


def nemo_rl_qwen3_235b() -> PublishedRun:
    hf = _model("qwen3_235b_a22b")
    par = ParallelismConfig(nodes=16, gpus_per_node=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=8,
                            context_parallel_size=2, expert_model_parallel_size=16, expert_tensor_parallel_size=1,
                            sequence_parallel=True, recompute_granularity="full")
    cfg = _recipe("nemo-rl-v0.6-qwen3-235b-16n8g", hf, 8192, par, dict(tensor_parallel_size=16),
                  TrainerConfig(global_batch_size=512, micro_batch_size=1, max_tokens_per_microbatch=8192), 1)
    return PublishedRun("Qwen3-235B-A22B", "NeMo-RL v0.6 H100 BF16, on-policy GRPO, 128 GPUs", cfg, hf,
                        5698, 395.0, 58.9, ("context parallelism 2", "PP 8 over 94 layers (uneven stages)"))


def nemo_rl_qwen3_30b() -> PublishedRun:
    hf = _model("qwen3_30b_a3b")
    par = ParallelismConfig(nodes=4, gpus_per_node=8, tensor_model_parallel_size=1, expert_model_parallel_size=8,
                            expert_tensor_parallel_size=1)
    # 16 vLLM engines of TP 2 = one server per node of TP 2 × DP 4 (experts TP-sharded, not EP).
    cfg = _recipe("nemo-rl-v0.6-qwen3-30ba3b-4n8g", hf, 4096, par,
                  dict(tensor_parallel_size=2, data_parallel_size=4),
                  TrainerConfig(global_batch_size=512, micro_batch_size=1, max_tokens_per_microbatch=4096), 4)
    return PublishedRun("Qwen3-30B-A3B", "NeMo-RL v0.6 H100 BF16, on-policy GRPO, 32 GPUs", cfg, hf,
                        3203, 192.0, 1102.0, ())


PUBLISHED = (nemo_rl_qwen3_235b, nemo_rl_qwen3_30b)
