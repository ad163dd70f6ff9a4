"""Delta weight sync on the `shm` transport: send only the elements an optimizer step changed.

At RL learning rates (1e-6) one step changes a few percent of the stored bf16 values; a dense sync
resends every byte. The servers already hold the last version the trainer sent, and so does the
trainer's host: the in-place segments in /dev/shm (`shm.SegmentWriter`) are that version, byte for
byte, which a restarted server is brought back from anyway. So each tensor of an update is compared
with its bytes there (bitwise: a -0.0 or a NaN is a change like any other) and, where it changed,
the changed elements go into patch files beside the segments as checkpoint-coordinate patches (HF
name, flat indices, values: vLLM 0.32's `CheckpointWeightPatch`), which every server's `mrl_shm`
engine applies through vLLM's own patch loader (`rollout/engines/shm.py`). Once every server has
loaded the round, the trainer writes the same patches into the segments, which then hold the new
version for the next comparison and for a restarted server (`DeltaRound.apply`). Until then they
hold the previous version, complete: a server restarted in the middle of the round is brought back
to it dense and then takes the round's patches like the others.

A tensor whose changed fraction passes the break-even (`break_even`) goes whole (a dense patch). A
whole round is dense: the first sync (nothing to compare with), every `rollout.sync_dense_every`
versions (a safety net), a diagnosis' re-send (the checksums compare whole tensors), and a round
whose stream differs from the last one's (another set or layout of tensors: LoRA's first merged
sync after the base, QLoRA's first full sync and the adapted-only ones after it), which turns
dense at the first tensor that differs (`DeltaRound` reports it; the transport then writes in
place, as a dense round does).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

Mode = Literal["auto", "on", "off"]

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def index_dtype(numel: int) -> torch.dtype:
    """int32 flat indices where they fit (vLLM's sparse_nccl engine requires int32), else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def break_even(dtype: torch.dtype, numel: int) -> float:
    """The changed fraction above which a sparse patch (an index and a value per changed element)
    costs more bytes than the whole tensor: 1/3 for bf16 with int32 indices, 1/2 for fp32."""
    value = dtype.itemsize
    return value / (value + index_dtype(numel).itemsize)


# vLLM's sparse patches mark unchanged elements with NaN and mask them in a patched `Tensor.copy_`
# (vllm/model_executor/model_loader/checkpoint_weight_patch.py:58-82); a weight loader that assigns
# a slice instead (`param.data[a:b] = …`: the short convolution of Gated DeltaNet and Mamba,
# layers/mamba/gdn/qwen_gdn_linear_attn.py:538-545, mamba_mixer2.py:246-251) would write the NaNs
# into the live weights on a GPU. Those tensors always go whole.
WHOLE_ONLY = (".conv1d.",)


def whole_only(name: str) -> bool:
    """`name` (an HF tensor) is loaded by a vLLM loader that a sparse patch would corrupt."""
    return any(part in name for part in WHOLE_ONLY)


def holds_nan(values: torch.Tensor) -> bool:
    """Whether a delta's changed values hold NaN, which vLLM's patch loader reserves for
    "unchanged" and refuses as a value (checkpoint_weight_patch.py): every delta round would fail
    on the servers, and a NaN weight is a diverged run anyway."""
    return values.is_floating_point() and bool(torch.isnan(values).any())


def refuse_nan(name: str, values: torch.Tensor) -> None:
    """Stop on a NaN among a delta's changed values (`values`, of tensor `name`): `holds_nan`."""
    if holds_nan(values):
        raise RuntimeError(f"delta sync: {name} holds NaN (the training diverged): stopping instead of sending it")


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat indices (int64) where `new` and `old` (same dtype and shape, on the host) differ bitwise."""
    bits = INT_OF_SIZE[new.element_size()]
    return torch.nonzero(new.reshape(-1).view(bits) != old.reshape(-1).view(bits)).squeeze(1)


class PatchArea(Protocol):
    """Where a round's patches are written (`shm.PatchFiles`): the place of each one written, and
    a view of what was written there."""

    def write(self, data: torch.Tensor) -> tuple[int, int]: ...

    def view(self, at: tuple[int, int], count: int, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass
class DeltaStats:
    """What one round sent: the metrics `sync/bytes`, `sync/changed_frac`, `sync/dense`."""

    bytes: int = 0
    """Bytes written for the servers to read (patches, or the whole tensors of a dense round)."""
    changed: int = 0
    elements: int = 0
    dense: bool = True
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("compare_s", "write_s", "apply_s"), 0.0))
    """The trainer's side of a delta round by phase (not a metric: `bench/sync_bench.py --delta`
    reports it): comparing with the segments, writing the patches, applying them after the load."""

    def report(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "changed_frac": self.changed / max(1, self.elements), "dense": int(self.dense)}


@dataclass
class DeltaPolicy:
    """Which rounds go dense (`rollout.sync_delta`, `rollout.sync_dense_every`)."""

    mode: Mode = "off"
    dense_every: int = 20
    since_dense: int = 0
    """Delta rounds since the last dense one."""
    dense_next: bool = False
    """Set by the diagnosis (`diagnose.DigestingTransport`): its re-send compares whole tensors."""

    def wants_delta(self, has_base: bool) -> bool:
        if self.mode == "off" or not has_base or self.dense_next:
            return False
        return self.since_dense + 1 < self.dense_every

    def done(self, dense: bool) -> None:
        self.since_dense = 0 if dense else self.since_dense + 1
        self.dense_next = False


@dataclass
class PatchEntry:
    """One tensor's patch, a manifest row [name, dtype, shape, index dtype (None: whole), count,
    [index file, offset], [value file, offset]] (`rollout/engines/shm.py` reads it)."""

    name: str
    dtype: str
    shape: list[int]
    index_dtype: str | None
    count: int
    indices_at: tuple[int, int]
    values_at: tuple[int, int]

    def row(self) -> list[Any]:
        return [self.name, self.dtype, self.shape, self.index_dtype, self.count, list(self.indices_at),
                list(self.values_at)]


@dataclass
class DeltaRound:
    """One delta round's patches, written into `files` (the patch area) as the tensors come."""

    base: list[list[Any]]
    """The segments' manifest entries, [name, dtype, shape, segment, offset]: the previous version."""
    segments: list[torch.Tensor]
    """The segments' bytes (the previous version until `apply`)."""
    patches: list[PatchEntry] = field(default_factory=list)
    stats: DeltaStats = field(default_factory=lambda: DeltaStats(dense=False))
    staged: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = field(default_factory=list)
    """Per patch: the segment view it goes into, its indices (None: whole), its values (views of
    the patch area)."""

    def matches(self, k: int, entry: list[Any]) -> bool:
        """The k-th tensor of this stream is where the previous version had it (same name, dtype,
        shape, place): else the round cannot be a delta."""
        return k < len(self.base) and self.base[k] == entry

    def add(self, t: torch.Tensor, entry: list[Any], area: PatchArea) -> None:
        segment, offset = entry[3], entry[4]
        host = t.detach().to("cpu").contiguous().reshape(-1)        # the trainer's copy, leaving its GPU
        old = self.segments[segment][offset:offset + t.nbytes].view(t.dtype)
        start = time.perf_counter()
        where = changed(host, old)
        self.stats.seconds["compare_s"] += time.perf_counter() - start
        self.stats.changed += where.numel()
        self.stats.elements += host.numel()
        if not where.numel():
            return
        refuse_nan(entry[0], host[where])
        start = time.perf_counter()
        try:
            self._write(t, host, old, where, entry, area)
        finally:
            self.stats.seconds["write_s"] += time.perf_counter() - start

    def _write(self, t: torch.Tensor, host: torch.Tensor, old: torch.Tensor, where: torch.Tensor,
               entry: list[Any], area: PatchArea) -> None:
        name, dtype, shape = entry[:3]
        sparse_ok = t.dtype.is_floating_point and not whole_only(name)     # NaN marks, `copy_` loaders
        if not sparse_ok or where.numel() > break_even(t.dtype, host.numel()) * host.numel():
            values_at = area.write(host.view(torch.uint8))
            self.patches.append(PatchEntry(name, dtype, shape, None, host.numel(), (0, 0), values_at))
            self.staged.append((old, None, area.view(values_at, host.numel(), t.dtype)))
            self.stats.bytes += host.nbytes
            return
        idx = where.to(index_dtype(host.numel()))
        indices_at = area.write(idx.view(torch.uint8))
        values_at = area.write(host[where].view(torch.uint8))
        self.patches.append(PatchEntry(name, dtype, shape, str(idx.dtype).removeprefix("torch."), idx.numel(),
                                       indices_at, values_at))
        self.staged.append((old, area.view(indices_at, idx.numel(), idx.dtype),
                            area.view(values_at, idx.numel(), t.dtype)))
        self.stats.bytes += idx.nbytes + idx.numel() * t.element_size()

    def apply(self) -> None:
        """The patches into the segments, which then hold the new version (after the servers loaded:
        they read the previous one there)."""
        start = time.perf_counter()
        for old, idx, values in self.staged:
            if idx is None:
                old.copy_(values)
            else:
                old[idx.long()] = values
        self.staged = []
        self.stats.seconds["apply_s"] += time.perf_counter() - start


def apply_rows(segments: list[torch.Tensor], tensors: list[list[Any]], rows: list[list[Any]],
               files: list[torch.Tensor]) -> None:
    """A delta round's patches (`PatchEntry.row`s, in the patch `files`) into another node's copy
    of the segments (`tensors`: its entries [name, dtype, shape, segment, offset]), as
    `DeltaRound.apply` does into rank 0's (`network.py`: each rollout node's receiver)."""
    where = {t[0]: (t[3], t[4]) for t in tensors}
    for name, dtype, shape, index_dtype, count, (iseg, ioff), (vseg, voff) in rows:
        if name not in where:
            raise KeyError(f"a patch of {name!r}, which this node's copy does not hold")
        seg, offset = where[name]
        dt = getattr(torch, dtype)
        old = segments[seg][offset:offset + math.prod(shape) * dt.itemsize].view(dt)
        values = files[vseg][voff:voff + count * dt.itemsize].view(dt)
        if index_dtype is None:
            old.copy_(values)
        else:
            it = getattr(torch, index_dtype)
            old[files[iseg][ioff:ioff + count * it.itemsize].view(it).long()] = values
