"""Streaming access to HF safetensors checkpoints: lazy reads, sharded atomic writes.

Reading memory-maps one shard at a time and returns single tensors, so converting a model never
holds more than the tensors of one layer. Writing goes to a temporary sibling directory that is
renamed into place only after the index is written: an interrupted conversion leaves no directory
that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Tokenizer and generation files copied next to converted weights.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not match the model."""


class HFCheckpointReader:
    """Tensor-by-tensor reader of an HF directory (single file or sharded with an index)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        index = self.dir / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SINGLE).is_file():
            with safe_open(str(self.dir / SINGLE), "pt") as f:
                weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise CheckpointError(f"{self.dir}: no {INDEX} or {SINGLE}")
        self.weight_map: dict[str, str] = weight_map
        self._open: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shard_files(self) -> list[Path]:
        return [self.dir / f for f in sorted(set(self.weight_map.values()))]

    def get(self, name: str) -> torch.Tensor:
        try:
            file = self.weight_map[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing") from None
        if file not in self._open:
            self._open[file] = safe_open(str(self.dir / file), "pt")
        return self._open[file].get_tensor(name)

    def close(self) -> None:
        self._open.clear()


class HFCheckpointWriter:
    """Writes tensors into shards of at most `max_shard_bytes`, then an index, then renames."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 << 30) -> None:
        self.out = Path(out_dir)
        self.tmp = self.out.with_name(f".{self.out.name}.partial-{os.getpid()}")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.max_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self.bytes_written = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.nbytes
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size

    def add_many(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.add(name, tensor)

    def _flush(self) -> None:
        if not self._pending:
            return
        file = f"part-{len(self._files):05d}.safetensors"
        save_file(self._pending, str(self.tmp / file), metadata={"format": "pt"})
        self._files.append((file, list(self._pending)))
        self.bytes_written += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def finish(self, side_files_from: str | Path | None = None, config: dict[str, Any] | None = None) -> Path:
        """Name shards HF-style, write the index and side files, and move into place."""
        self._flush()
        total = len(self._files)
        weight_map = {}
        for i, (file, names) in enumerate(self._files):
            final = SINGLE if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            (self.tmp / file).rename(self.tmp / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.bytes_written}, "weight_map": dict(sorted(weight_map.items()))}
        if total > 1:
            (self.tmp / INDEX).write_text(json.dumps(index, indent=2))
        if side_files_from is not None:
            for name in SIDE_FILES:
                src = Path(side_files_from) / name
                if src.is_file():
                    shutil.copy2(src, self.tmp / name)
        if config is not None:
            (self.tmp / "config.json").write_text(json.dumps(config, indent=2))
        if self.out.exists():
            shutil.rmtree(self.out)
        self.tmp.rename(self.out)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
