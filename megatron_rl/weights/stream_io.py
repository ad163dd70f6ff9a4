"""Streaming safetensors I/O for checkpoint conversion: header-only inspection, and a writer that
puts every tensor straight into its final place in its shard file.

`HFCheckpointWriter` buffers a whole shard before writing it; `PlannedHFWriter` is given the list
of tensors (names, shapes, dtypes) up front, lays out the shards and their headers immediately and
then writes each tensor at its offset as it arrives, in any order. Its memory is therefore the
tensor in hand, not a shard, and it can tell which tensors never came. Finishing (HF shard names,
index, side files, atomic rename) is `HFCheckpointWriter.finish`.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .hf_io import CheckpointError, HFCheckpointReader, HFCheckpointWriter

# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec).
_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes of one safetensors file, from its header only (no tensor data)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its header)")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        out[name] = TensorInfo(name, tuple(meta["shape"]), _DTYPES[meta["dtype"]])
    return out


def checkpoint_tensor_infos(reader: HFCheckpointReader) -> dict[str, TensorInfo]:
    """Every tensor of an HF checkpoint (as its index lists them), from the shard headers."""
    infos: dict[str, TensorInfo] = {}
    for file in reader.shard_files():
        infos.update(read_header(file))
    listed = set(reader.weight_map)
    missing = sorted(listed - set(infos))
    if missing:
        raise CheckpointError(f"{reader.dir}: the index lists tensors that no shard holds: {', '.join(missing[:10])}")
    return {name: infos[name] for name in reader.weight_map}


def lossless_dtype(dtypes: set[torch.dtype]) -> torch.dtype:
    """A dtype every tensor of `dtypes` converts to and back from exactly: their common dtype,
    else float32 (holds bf16, fp16 and fp8 alike), else float64."""
    if len(dtypes) == 1:
        return next(iter(dtypes))
    return torch.float32 if all(d.is_floating_point and d.itemsize <= 4 for d in dtypes) else torch.float64


@dataclass
class _Slot:
    shard: int
    offset: int          # absolute byte offset in the shard file
    info: TensorInfo
    written: bool = False


class PlannedHFWriter(HFCheckpointWriter):
    """`add` tensors of `plan` in any order; `finish` refuses while any is missing."""

    def __init__(self, out_dir: str | Path, plan: list[TensorInfo], max_shard_bytes: int = 2 << 30) -> None:
        super().__init__(out_dir, max_shard_bytes)
        names = [t.name for t in plan]
        if len(set(names)) != len(names):
            raise ValueError("the write plan names a tensor twice")
        self._slots: dict[str, _Slot] = {}
        self._fds: dict[int, int] = {}
        self._left: list[int] = []
        for shard in self._group(plan):
            self._lay_out(shard)

    def _group(self, plan: list[TensorInfo]) -> list[list[TensorInfo]]:
        shards: list[list[TensorInfo]] = []
        size = 0
        for t in plan:
            if not shards or (shards[-1] and size + t.nbytes > self.max_bytes):
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += t.nbytes
        return shards

    def _lay_out(self, tensors: list[TensorInfo]) -> None:
        """Create the shard file: header now, data region sized (sparse) for the tensors to come."""
        index = len(self._files)
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        begin = 0
        for t in tensors:
            header[t.name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [begin, begin + t.nbytes]}
            begin += t.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-(8 + len(blob)) % 8)     # spaces pad the header; data starts 8-aligned
        file = f"part-{index:05d}.safetensors"
        fd = os.open(self.tmp / file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, struct.pack("<Q", len(blob)) + blob)
        base = 8 + len(blob)
        os.ftruncate(fd, base + begin)
        offset = base
        for t in tensors:
            self._slots[t.name] = _Slot(index, offset, t)
            offset += t.nbytes
        self._fds[index] = fd
        self._left.append(len(tensors))
        self._files.append((file, [t.name for t in tensors]))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        slot = self._slots.get(name)
        if slot is None:
            raise CheckpointError(f"tensor {name!r} is not in the write plan")
        if slot.written:
            raise CheckpointError(f"tensor {name!r} was written twice")
        if tuple(tensor.shape) != slot.info.shape or tensor.dtype != slot.info.dtype:
            raise CheckpointError(f"{name}: planned {list(slot.info.shape)} {slot.info.dtype}, "
                                  f"got {list(tensor.shape)} {tensor.dtype}")
        if tensor.numel():
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            # ndarray.data is memoryview(data); numpy's stubs give ndarray the buffer protocol only on 3.12+
            _pwrite_all(self._fds[slot.shard], data.data, slot.offset)
        slot.written = True
        self.bytes_written += slot.info.nbytes
        self._left[slot.shard] -= 1
        if self._left[slot.shard] == 0:
            os.close(self._fds.pop(slot.shard))

    def _flush(self) -> None:
        """Nothing is ever pending: tensors are written where they belong as they arrive."""

    def missing(self) -> list[str]:
        return [name for name, slot in self._slots.items() if not slot.written]

    def finish(self, side_files_from: str | Path | None = None, config: dict | None = None) -> Path:
        missing = self.missing()
        if missing:
            raise CheckpointError(f"{len(missing)} planned tensor(s) were never written: {', '.join(missing[:20])}")
        self._close_all()
        return super().finish(side_files_from, config)

    def abort(self) -> None:
        self._close_all()
        super().abort()

    def _close_all(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
