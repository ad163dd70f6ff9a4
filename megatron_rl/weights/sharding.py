"""One rank's Megatron parameters ↔ the adapter's global, unsharded tensors.

Local names count layers within the pipeline stage and experts within the expert-parallel rank;
global names count over the whole model. Tensor parallelism splits along the parameter's
`partition_dim`. Fused tensors made of sections are split per section, so each rank holds
[a_r; b_r; ...], never a contiguous slice of [a; b; ...]: Megatron's gate/up (`linear_fc1` under a
gated linear unit) has two equal halves; other modules name their sections on the parameter
(`TP_SECTIONS_ATTR`, e.g. Gated DeltaNet's fused in_proj [q; k; v; z; beta; alpha] and conv1d).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import gather_plan

from ..megatron.actor import unwrap  # isort: skip  (requires the entry point's cpu_compat.apply())

from megatron.core import parallel_state as ps  # noqa: E402

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
"""TE's grouped-GEMM experts (`TEGroupedMLP`): expert i's weight is `experts.linear_fc1.weight{i}`."""
from ..megatron.quantize import dequantize  # noqa: E402
from ..megatron.sections import GDN_SHARDED_KEYS, LORA_PARAM_ATTR, TP_SECTIONS_ATTR  # noqa: E402  (beside the providers that set them)


@dataclass
class LocalParam:
    local_name: str
    global_name: str
    param: torch.Tensor
    layer: int | None
    is_expert: bool
    tp_dim: int | None
    sections: tuple[int, ...] | None
    """Local section sizes along `tp_dim` when the tensor is fused from separately split parts."""

    @property
    def tp_group(self) -> Any:
        return ps.get_expert_tensor_parallel_group() if self.is_expert else ps.get_tensor_model_parallel_group()

    @property
    def tp_size(self) -> int:
        return dist.get_world_size(self.tp_group) if self.tp_dim is not None else 1

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp_group) if self.tp_dim is not None else 0

    @property
    def full_nbytes(self) -> int:
        return self.param.nbytes * self.tp_size

    def in_first_replica(self) -> bool:
        """Data-parallel rank 0 (for its kind, dense or expert): the replica whose copy is used."""
        if self.is_expert:
            return ps.get_expert_data_parallel_rank() == 0
        return ps.get_data_parallel_rank(with_context_parallel=True) == 0

    def owns(self) -> bool:
        """One rank per global tensor writes it: TP rank 0 of data-parallel rank 0. Also for a
        parameter replicated over TP (a norm), which every TP rank holds whole."""
        return self.in_first_replica() and dist.get_rank(self.tp_group) == 0


@functools.cache
def te_aliases() -> dict[str, str]:
    """Transformer-Engine name prefix → local-spec name prefix, within a layer.

    TE fuses the norm before a linear into that linear (`linear_qkv.layer_norm_weight` is the
    local `input_layernorm.weight`). The table is the inverse of megatron's own
    `sharded_state_dict_keys_map` of the local specs (the map that lets dist-checkpoints cross the
    two specs), read from megatron-core, which needs no TE for it.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    local = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    maps = [local.submodules.sharded_state_dict_keys_map, GDN_SHARDED_KEYS]
    return {te: name for keys in maps for name, te in keys.items()}


def local_spec_name(name: str) -> str:
    """A parameter name of either spec (TE or local) in the local spec's naming, which the
    weight map uses. Layer and expert numbers are kept as they are (local)."""
    m = _LAYER.match(name)
    if not m:
        return name
    prefix, rest = name[:m.end()], name[m.end():]
    for te, local in te_aliases().items():
        if rest.startswith(te):
            return prefix + local + rest[len(te):]
    g = _GROUPED_EXPERT.search(rest)
    if g:
        rest = rest[:g.start()] + f".experts.local_experts.{g.group(3)}.{g.group(1)}.{g.group(2)}"
    return prefix + rest


def local_params(model: torch.nn.Module) -> list[LocalParam]:
    """This rank's parameters with their global names and sharding."""
    gpt = unwrap(model)
    config = gpt.config
    out = []
    for name, param in gpt.named_parameters():
        if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
            continue   # a copy of the embedding on the last stage, not a weight of its own
        if getattr(param, LORA_PARAM_ATTR, False):
            continue   # an adapter: no weight of the base model (see megatron/lora.py)
        layer = None
        global_name = local_spec_name(name)
        m = _LAYER.match(global_name)
        if m:
            local = int(m.group(1))
            layer = gpt.decoder.layers[local].layer_number - 1
            global_name = f"decoder.layers.{layer}." + global_name[m.end():]
        e = _EXPERT.search(global_name)
        if e:
            num_local = config.num_moe_experts // ps.get_expert_model_parallel_world_size()
            expert = ps.get_expert_model_parallel_rank() * num_local + int(e.group(1))
            global_name = global_name[:e.start()] + f".local_experts.{expert}." + global_name[e.end():]
        tp_dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
        out.append(LocalParam(name, global_name, param, layer, e is not None, tp_dim,
                              _sections(param, global_name, bool(config.gated_linear_unit), tp_dim)))
    return out


def tied_output_copies(model: torch.nn.Module) -> list[LocalParam]:
    """The last pipeline stage's copy of a tied embedding (PP > 1), as the embedding's shard.

    `local_params` leaves it out (it is no weight of its own: weights leave Megatron from the first
    stage), but loading must fill it: megatron only copies the embedding into it at construction,
    so a model loaded afterwards would keep its random LM head on the last stage.
    """
    gpt = unwrap(model)
    if not (gpt.share_embeddings_and_output_weights and gpt.post_process and not gpt.pre_process):
        return []
    param = gpt.output_layer.weight
    return [LocalParam("output_layer.weight", "embedding.word_embeddings.weight", param, None, False,
                       getattr(param, "partition_dim", 0), None)]


def _sections(param: torch.Tensor, global_name: str, glu: bool, tp_dim: int | None) -> tuple[int, ...] | None:
    if tp_dim is None:
        return None
    named = getattr(param, TP_SECTIONS_ATTR, None)
    if named is not None:
        return tuple(int(n) for n in named)
    if glu and global_name.endswith("linear_fc1.weight"):
        half = param.shape[tp_dim] // 2
        return (half, half)
    return None


def shard(full: torch.Tensor, p: LocalParam) -> torch.Tensor:
    """This rank's slice of a full tensor."""
    if p.tp_dim is None or p.tp_size == 1:
        return full
    if p.sections is not None:
        parts = torch.split(full, [n * p.tp_size for n in p.sections], dim=p.tp_dim)
        return torch.cat([s.chunk(p.tp_size, p.tp_dim)[p.tp_rank] for s in parts], dim=p.tp_dim)
    return full.chunk(p.tp_size, p.tp_dim)[p.tp_rank]


def unshard(p: LocalParam) -> torch.Tensor | None:
    """The full tensor on TP rank 0 of the parameter's group; None on the other TP ranks, which
    only send their shard (collective over that group). Gathering to one rank instead of all
    spares every other TP rank a full copy: a 151,936-row embedding is 1.2 GB in bf16.

    An unsharded parameter comes back as itself (detached, not copied): read it, copy it, but do
    not keep it across an optimizer step or write into it.
    """
    local = dequantize(p.param.detach())      # a QLoRA base leaves dense (its NF4 image), shard by shard
    if p.tp_dim is None or p.tp_size == 1:
        return local
    local = local.contiguous()
    if p.tp_rank != 0:
        dist.gather(local, None, group=p.tp_group, group_dst=0)
        return None
    if p.sections is None and p.tp_dim == 0:
        # Shards of dim 0 are contiguous row blocks of the result: received in place, no cat.
        full = torch.empty((local.shape[0] * p.tp_size, *local.shape[1:]), dtype=local.dtype, device=local.device)
        dist.gather(local, list(full.chunk(p.tp_size, 0)), group=p.tp_group, group_dst=0)
        return full
    parts = [torch.empty_like(local) for _ in range(p.tp_size)]
    dist.gather(local, parts, group=p.tp_group, group_dst=0)
    if p.sections is not None:
        per_rank = [torch.split(t, list(p.sections), dim=p.tp_dim) for t in parts]
        return torch.cat([torch.cat([r[i] for r in per_rank], dim=p.tp_dim) for i in range(len(p.sections))],
                         dim=p.tp_dim)
    return torch.cat(parts, dim=p.tp_dim)


def load_full_tensors(model: torch.nn.Module, get_full: Callable[[str], torch.Tensor]) -> list[str]:
    """Copy `get_full(global_name)` (sharded for this rank) into every local parameter.

    Shape mismatches raise with the tensor's name; returns the global names loaded.
    """
    loaded = []
    with torch.no_grad():
        for p in local_params(model) + tied_output_copies(model):
            piece = shard(get_full(p.global_name), p)
            if tuple(piece.shape) != tuple(p.param.shape):
                raise ValueError(f"{p.global_name}: checkpoint shard has shape {tuple(piece.shape)}, "
                                 f"model expects {tuple(p.param.shape)} (TP {p.tp_size})")
            p.param.copy_(piece.to(p.param.dtype))
            loaded.append(p.global_name)
    return loaded


GATHER_CHUNK_BYTES = 32 << 20
"""Rank 0 takes a layer in parts of about this many bytes (one tensor may exceed it)."""


Transform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""What an owner hands on instead of the tensors it owns (`gather_to_rank0`'s `transform`)."""


def gather_to_rank0(model: torch.nn.Module, layers: list[int | None], chunk_bytes: int = GATHER_CHUNK_BYTES,
                    only: set[str] | None = None,
                    transform: Transform | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Per layer (global order), all global tensors collected on global rank 0 ({} elsewhere), in
    parts of about `chunk_bytes`: a layer of a 128-expert model, or a 151,936-row embedding, is GBs.
    Each rank unshards its parameters a part at a time too, and only the first data-parallel
    replica unshards at all.

    Each rank contributes the tensors it owns. Every rank yields once per part, in step.
    `only`: just these global names (LoRA's touched tensors); layers without one yield nothing.
    `transform`: applied by each owner to its tensors of a part before they go (the delta sync's
    patches, `sync/owners.py`); rank 0 then collects what it returns.
    """
    by_layer: dict[int | None, list[LocalParam]] = {}
    for p in local_params(model):
        if p.in_first_replica() and (only is None or p.global_name in only):
            by_layer.setdefault(p.layer, []).append(p)
    world_rank = dist.get_rank()
    device = next(unwrap(model).parameters()).device
    for layer in layers:
        # TP peers hold the same parameters, so they cut the same runs and meet in the same gathers.
        runs = gather_plan.runs(by_layer.get(layer, []), lambda p: p.full_nbytes, chunk_bytes)
        count = torch.tensor([len(runs)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        for i in range(int(count.item())):
            mine = {}
            for p in runs[i] if i < len(runs) else []:
                full = unshard(p)
                if p.owns():
                    assert full is not None, "owners are TP rank 0"
                    mine[p.global_name] = full
            if transform is not None and mine:
                mine = transform(mine)
            yield from _collect_on_rank0(mine, world_rank, device, chunk_bytes)


def _collect_on_rank0(mine: dict[str, torch.Tensor], world_rank: int, device: torch.device,
                      chunk_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Every rank's tensors on rank 0, part by part (`gather_plan`). Only names, shapes and dtypes
    go through the object collectives; the data goes point to point into buffers of the right
    shape, one batch per part (gathering the tensors as objects costs their pickles plus a
    world-size buffer)."""
    # A tensor off `device` would go over gloo (the world group picks the backend by device) while
    # rank 0 waits on NCCL: the rank reports it instead of its specs, and every rank raises.
    misplaced = [f"{n} is on {t.device}; the gather sends from {device}" for n, t in mine.items() if t.device != device]
    specs: list[Any] | None = [None] * dist.get_world_size() if world_rank == 0 else None
    dist.gather_object(misplaced[0] if misplaced else [(n, tuple(t.shape), t.dtype) for n, t in mine.items()],
                       specs, dst=0)
    plan: list[Any] = [None]
    if specs is not None:
        plan[0] = next((s for s in specs if isinstance(s, str)), None) or gather_plan.plan_parts(specs, chunk_bytes)
    dist.broadcast_object_list(plan, src=0)
    if isinstance(plan[0], str):
        raise RuntimeError(plan[0])        # on every rank, so none waits in a collective
    for part in plan[0]:
        if world_rank != 0:
            outgoing = [mine.pop(name).contiguous() for _, name, _, _ in gather_plan.sends(part, world_rank)]
            _exchange([dist.P2POp(dist.isend, t, 0) for t in outgoing])
            del outgoing                   # freed once sent
            yield {}
            continue
        out = {name: mine.pop(name) for src, name, _, _ in part if src == 0}
        ops = []
        for src, name, shape, dtype in gather_plan.receives(part):
            out[name] = torch.empty(shape, dtype=dtype, device=device)   # NCCL: this rank's GPU; gloo: CPU
            ops.append(dist.P2POp(dist.irecv, out[name], src))
        _exchange(ops)
        yield {name: out[name] for _, name, _, _ in part}                  # plan order, as before


def _exchange(ops: list[dist.P2POp]) -> None:
    """One part's sends or receives as one batch, waited for (the receiving buffers are read next;
    `wait` orders the current stream after NCCL's). Under NCCL the batch uses the world group's
    communicator, which the count all-reduce in `gather_to_rank0` has created on every rank
    before (a first batch on a group needs all its ranks). A rank with nothing in the part has no
    batch: `batch_isend_irecv` refuses an empty list."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def gather_hf_layers(model: torch.nn.Module, adapter: Any, only: set[str] | None = None,
                     on_owner: Transform | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Per part of a layer (global order, see `gather_to_rank0`), the full HF-named tensors on
    global rank 0 ([] elsewhere).

    Collective over all ranks; the one path by which weights leave Megatron (sync, export,
    conversion), so they all go through the same weight map. With `on_owner`, each owner converts
    its own tensors and hands their HF-named dict to `on_owner`, and rank 0 gets what that returns
    (a delta sync's patches, compared where the tensors are: `sync/owners.py`).
    """
    def to_hf(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(pair for name, tensor in tensors.items()
                    for pair in adapter.to_hf(adapter.entry_for_mcore(name), tensor))

    if on_owner is not None:
        for part in gather_to_rank0(model, adapter.layers(), only=only, transform=lambda t: on_owner(to_hf(t))):
            yield list(part.items())
        return
    for part in gather_to_rank0(model, adapter.layers(), only=only):
        yield list(to_hf(part).items())
