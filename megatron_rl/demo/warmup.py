"""Short supervised warm-up of the tiny HF model on the expert answers (plain torch, CPU).

It teaches the `[ans]x[/ans]` format; how often the letter is right after it is what RL improves.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch


def encode_pairs(tokenizer: Any, sft_records: list[Any]) -> list[tuple[list[int], int]]:
    out = []
    for r in sft_records:
        prompt = list(tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
        answer = tokenizer(r.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + answer, len(prompt)))
    return out


def supervised_warmup(model_dir: Path, out_dir: Path, pairs: list[tuple[list[int], int]], steps: int,
                      batch_size: int, lr: float, seed: int) -> list[float]:
    """Train on the answer tokens only; save to `out_dir`; return the loss curve."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        batch = rng.sample(pairs, batch_size)
        width = max(len(seq) for seq, _ in batch)
        ids = torch.zeros(batch_size, width, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for i, (seq, plen) in enumerate(batch):
            ids[i, :len(seq)] = torch.tensor(seq)
            labels[i, plen:len(seq)] = torch.tensor(seq[plen:])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.save_pretrained(out_dir)
    return losses
