"""Build (once, cached) the demo's assets: task data, tokenizer, tiny model, warmed-up weights."""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..data.schema import read_sft
from ..weights.tiny import build_tiny_hf_checkpoint
from .task import corpus, write_task
from .tokenizer import train_tokenizer
from .warmup import encode_pairs, supervised_warmup

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def prepare_demo_assets(cache: Path, tiny_fields: dict[str, Any], seed: int = 0, warmup_steps: int = 200,
                        n_train: int = 2000, n_eval: int = 256) -> dict[str, Path]:
    """Paths of train/eval/sft JSONL and of the warmed-up model (HF dir with tokenizer);
    `warmup_steps=0` leaves the model as initialized (seconds instead of minutes)."""
    cache = Path(cache)
    key = json.dumps({"fields": tiny_fields, "seed": seed, "warmup": warmup_steps, "n": [n_train, n_eval],
                      "v": 1}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()
    stamp = cache / ".stamp"
    paths = {"train": cache / "train.jsonl", "eval": cache / "eval.jsonl", "sft": cache / "sft.jsonl",
             "model": cache / "model"}
    if stamp.is_file() and stamp.read_text() == digest:
        return paths
    with _build_lock(cache):
        if stamp.is_file() and stamp.read_text() == digest:      # another process built it meanwhile
            return paths
        _build(cache, paths, tiny_fields, seed, warmup_steps, n_train, n_eval)
        stamp.write_text(digest)
    return paths


@contextmanager
def _build_lock(cache: Path) -> Iterator[None]:
    """One builder at a time per cache dir (two test workers, or two demos, asking at once would
    otherwise delete the folder under each other). The lock file sits beside the folder, which a
    build deletes and recreates."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f".{cache.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(cache: Path, paths: dict[str, Path], tiny_fields: dict[str, Any], seed: int, warmup_steps: int,
           n_train: int, n_eval: int) -> None:
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    print(f"[demo] building task data, tokenizer and tiny model in {cache} (once)", flush=True)
    write_task(cache, n_train, n_eval, seed)
    tok_dir = train_tokenizer(corpus(4000, seed + 1), cache / "tokenizer", vocab_size=tiny_fields["vocab_size"])
    init_dir = build_tiny_hf_checkpoint(tiny_fields, cache / "model_init", seed=seed)
    _copy_tokenizer(tok_dir, init_dir)
    if warmup_steps == 0:                  # a random model: enough where nothing has to learn
        shutil.copytree(init_dir, paths["model"])
    else:
        _warm_up(tok_dir, init_dir, paths, warmup_steps, seed)
    _copy_tokenizer(tok_dir, paths["model"])


def _warm_up(tok_dir: Path, init_dir: Path, paths: dict[str, Path], steps: int, seed: int) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    pairs = encode_pairs(tokenizer, read_sft(paths["sft"]))
    losses = supervised_warmup(init_dir, paths["model"], pairs, steps, batch_size=32, lr=3e-3, seed=seed)
    print(f"[demo] supervised warm-up: {steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
