"""Batch predictions for evaluation: prompts JSONL → a rollout server → raw-output JSONL.

Same prompt rendering as training (the model's chat template over the record's messages, with the
chat-template variables of the recipe or of the command line). The server is shaped like the
recipe's rollout servers (`RolloutConfig`: TP × DP GPUs on this node, expert parallelism), so a
checkpoint that needs several GPUs is evaluated the way it was sampled in training. Decoding is
greedy unless asked otherwise (`Decoding`).

The output lines (`{"problem_id", "output"}`) are what `megatron-rl eval igakuqa|mcq --pred`
score; `<out>.meta.json` beside them records the model, the decoding settings and the server
shape, so a score can be traced to how its answers were produced.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.schema import RolloutConfig
from ..data.prompts import prompt_token_ids
from ..data.schema import read_prompts
from .client import RolloutClient
from .server import RolloutServer


@dataclass(frozen=True)
class Decoding:
    temperature: float = 0.0
    """0 = greedy (top_p and top_k are then not applied)."""
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 512
    seed: int = 0
    """The server's sampling seed (matters only with temperature > 0)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampling(self, rollout: RolloutConfig) -> RolloutConfig:
        """The server's `RolloutConfig` with one sample per prompt of these settings (the client
        drops top_p and top_k when `greedy`)."""
        return dataclasses.replace(rollout, n=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                   max_response_length=self.max_tokens)


def meta_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".meta.json")


def predict(model_dir: str, prompts_path: str, out_path: Path, run_dir: Path, decoding: Decoding | None = None,
            limit: int | None = None, cfg: RolloutConfig | None = None, recipe: str | None = None) -> int:
    """Write one prediction per prompt (and `<out>.meta.json`); returns how many were written."""
    from transformers import AutoTokenizer

    decoding = decoding or Decoding()
    # Any, like the tokenizer parameters elsewhere: transformers types apply_chat_template's result as
    # the union over its flags, not the BatchEncoding that return_dict=True gives.
    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    records = read_prompts(prompts_path)[:limit]
    ids = [prompt_token_ids(tokenizer, r.messages, decoding.chat_template_kwargs) for r in records]
    cfg = cfg or RolloutConfig(enforce_eager=True)
    max_tokens = decoding.max_tokens
    context = int(json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 4096))
    too_long = [r.id for r, x in zip(records, ids) if len(x) + max_tokens > context]
    if too_long:
        raise ValueError(f"{len(too_long)} prompts do not fit the model's context of {context} tokens with "
                         f"--max-tokens {max_tokens} (first: {too_long[:3]})")
    server = RolloutServer(model_dir, run_dir, cfg, max_model_len=max(len(x) for x in ids) + max_tokens)
    started = time.time()
    try:
        server.start()
        if decoding.temperature > 0:
            server.rpc("mrl_reseed", str(decoding.seed))
        client = RolloutClient.for_server(server, cfg)
        results = client.generate(ids, decoding.sampling(cfg), greedy=decoding.greedy)
    finally:
        server.stop()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record, samples in zip(records, results):
            text = tokenizer.decode(samples[0].response_ids, skip_special_tokens=True)
            line: dict[str, Any] = {"problem_id": record.id, "output": text}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    tmp.replace(out_path)
    meta = {"model": str(model_dir), "prompts": str(prompts_path), "predictions": len(records),
            "recipe": recipe, "decoding": dataclasses.asdict(decoding),
            "server": {"tensor_parallel_size": cfg.tensor_parallel_size, "data_parallel_size": cfg.data_parallel_size,
                       "enable_expert_parallel": cfg.enable_expert_parallel, "dtype": cfg.dtype,
                       "gpus": cfg.tensor_parallel_size * cfg.data_parallel_size},
            "seconds": round(time.time() - started, 1)}
    meta_path(out_path).write_text(json.dumps(meta, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return len(records)
