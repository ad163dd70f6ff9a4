"""Delta sync compared where the weights are: each rank that owns a part of the model (`send_plan.py`:
TP rank 0 of the first data-parallel replica, for its stage and its experts) keeps on its host the
HF tensors of that part as it last sent them, compares each new one with it (bitwise, `delta.changed`)
and hands on only the changed elements; rank 0 collects the patches and the transport sends them
(`network.py`, servers on rollout nodes).

Before this, rank 0 gathered every tensor of the model and compared it with a copy of the whole
model on its own host: for Qwen3-235B 470 GB over rank 0's NIC and 470 GB of device-to-host copies
on rank 0 every step (17.8 s of the planned 21.3 s sync). Here each of the owners (64 on the
235B recipe) copies and compares its own part, at once, and only the patches cross the network
(`planner/timing.py`: 6.7 s planned).

What rank 0 collects in a delta round, per changed tensor `name` (`patch_names`): `name|i` (flat
indices, int32 where they fit) and `name|v` (their values), or `name|w` (the whole tensor, past
the break-even or for a tensor a sparse patch would corrupt, `delta.whole_only`). A dense round
goes as before (every tensor whole), and each owner keeps a host copy of what it sent. Whether a
round is a delta is rank 0's decision (its transport's policy and its nodes' copies), told to every
rank before the gather (`sync_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .delta import break_even, changed, holds_nan, index_dtype, whole_only

SEP = "|"
INDICES, VALUES, WHOLE = "i", "v", "w"


@dataclass
class OwnerCopy:
    """This rank's host copy of the HF tensors it owns, as last sent; the counts of the last round."""

    held: dict[str, torch.Tensor] = field(default_factory=dict)
    changed: int = 0
    elements: int = 0
    nan: list[str] = field(default_factory=list)
    """The tensors of this round whose changed values hold NaN: not sent, and every rank stops
    after the gather (`sync._sync_by_owners`), not this one alone in the middle of it."""
    whole_past_break_even: bool = True
    """A tensor whose changed fraction passes the break-even goes whole. Not on `nccl`: vLLM's
    sparse_nccl format has no whole tensor (it goes as every index, `gpu.sparse_patches`), so
    the changed elements alone always cost fewer bytes there."""

    def begin(self) -> None:
        self.changed = self.elements = 0
        self.nan = []

    def keep(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, hold: bool = True) -> dict[str, torch.Tensor]:
        """A dense round: every tensor goes whole (in `dtype`); each is remembered on the host, or,
        without `hold` (no delta will follow it), forgotten."""
        out = {}
        for name, t in tensors.items():
            out[name] = t.detach().to(dtype)
            if hold:
                self.held[name] = out[name].to("cpu", copy=True).contiguous()
            else:
                self.held.pop(name, None)
            self.elements += t.numel()
        self.changed = self.elements
        return out

    def patches(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A delta round: the changed elements of each tensor, on the tensor's device (what the
        gather carries), and this copy updated to the new version."""
        out = {}
        for name, t in tensors.items():
            new = t.detach().to(dtype)
            host = new.to("cpu").contiguous().reshape(-1)
            old = self.held.get(name)
            if old is None or old.shape != new.shape or old.dtype != new.dtype:
                was = "absent" if old is None else f"{tuple(old.shape)} {old.dtype}"
                raise RuntimeError(f"delta sync: {name} {tuple(new.shape)} {new.dtype} is not in this rank's copy of "
                                   f"the last version ({was}): the stream changed, which needs a whole sync")
            flat = old.reshape(-1)
            where = changed(host, flat)
            self.changed += where.numel()
            self.elements += host.numel()
            if not where.numel():
                continue
            values = host[where]
            if holds_nan(values):
                self.nan.append(name)
                continue
            sparse_ok = new.dtype.is_floating_point and not whole_only(name)   # NaN marks, `copy_` loaders
            past = self.whole_past_break_even and where.numel() > break_even(new.dtype, host.numel()) * host.numel()
            if not sparse_ok or past:
                out[name + SEP + WHOLE] = new.reshape(-1)
                flat.copy_(host)
                continue
            out[name + SEP + INDICES] = where.to(index_dtype(host.numel())).to(new.device)
            out[name + SEP + VALUES] = values.to(new.device)
            flat[where] = values
        return out


def patch_names(part: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor | None, torch.Tensor]]:
    """What rank 0 collected (`OwnerCopy.patches`' keys): HF name → (indices, or None for a whole
    tensor; values)."""
    out: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}
    for key, t in part.items():
        name, _, kind = key.rpartition(SEP)
        if kind == WHOLE:
            out[name] = (None, t)
        elif kind == INDICES:
            out[name] = (t, part[name + SEP + VALUES])
        elif kind != VALUES:
            raise ValueError(f"delta sync: {key!r} is not a patch ({SEP}{INDICES}, {SEP}{VALUES} or {SEP}{WHOLE})")
    return out
