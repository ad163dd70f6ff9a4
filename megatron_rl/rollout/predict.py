"""Batch predictions for evaluation: prompts JSONL → the rollout server → raw-output JSONL.

Same prompt rendering as training (the model's chat template over the record's messages, which
instruct the `[ans]…[/ans]` format); greedy decoding. The output lines
(`{"problem_id", "output"}`) are what `megatron-rl eval igakuqa --pred` scores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config.schema import RolloutConfig
from ..data.schema import read_prompts
from .client import RolloutClient, SamplingSettings
from .server import RolloutServer


def predict(model_dir: str, prompts_path: str, out_path: Path, run_dir: Path, max_tokens: int = 512,
            limit: int | None = None, cfg: RolloutConfig | None = None) -> int:
    """Write one prediction per prompt; returns how many were written."""
    from transformers import AutoTokenizer

    # Any, like the tokenizer parameters elsewhere: transformers types apply_chat_template's result as
    # the union over its flags, not the BatchEncoding that return_dict=True gives.
    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    records = read_prompts(prompts_path)[:limit]
    ids = [list(tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]) for r in records]
    cfg = cfg or RolloutConfig(enforce_eager=True)
    context = int(json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 4096))
    too_long = [r.id for r, x in zip(records, ids) if len(x) + max_tokens > context]
    if too_long:
        raise ValueError(f"{len(too_long)} prompts do not fit the model's context of {context} tokens with "
                         f"--max-tokens {max_tokens} (first: {too_long[:3]})")
    server = RolloutServer(model_dir, run_dir, cfg, max_model_len=max(len(x) for x in ids) + max_tokens)
    try:
        server.start()
        client = RolloutClient.for_server(server, max_concurrency=cfg.max_concurrency)
        greedy = SamplingSettings(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens,
                                  logprobs_mode="raw")
        results = client.generate(ids, greedy)
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
    return len(records)
