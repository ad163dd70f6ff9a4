"""What the `sparse_nccl` delta sync sends (`sync/gpu.py`: `sparse_patch`, `sparse_update_request`,
`sparse_init_request`), on CPU: the patches applied to the previous version give the new one bit
for bit; whole tensors go as every index; and vLLM 0.32.0's own request types accept the bodies."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.sync.gpu import sparse_init_request, sparse_patch, sparse_update_request


def _apply(old: torch.Tensor, patch: tuple) -> torch.Tensor:  # type: ignore[type-arg]
    out = old.clone().reshape(-1)
    out[patch[1].long()] = patch[2]
    return out.reshape(patch[3])


def test_patches_rebuild_the_new_version_bitwise() -> None:
    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    new = old.clone()
    flat = new.view(-1)
    hit = torch.randperm(flat.numel(), generator=g)[:100]
    flat[hit] += torch.randn(100, generator=g).to(torch.bfloat16)
    flat[hit[:3]] = -0.0                                   # a sign flip of zero is a change too
    patch = sparse_patch("model.layers.0.mlp.gate_proj.weight", new, old)
    assert patch is not None and patch[1].dtype == torch.int32 and patch[3] == (64, 48)
    assert patch[1].numel() <= 100
    assert torch.equal(_apply(old, patch).view(torch.int16), new.view(torch.int16))
    assert sparse_patch("w", new, new.clone()) is None      # nothing changed: nothing sent


def test_whole_tensors_go_as_every_index() -> None:
    old = torch.zeros(10, dtype=torch.bfloat16)
    new = torch.arange(10, dtype=torch.bfloat16)           # 9 of 10 changed: past the break-even
    for name, prev in (("w", old), ("w", None), ("model.layers.0.linear_attn.conv1d.weight", new - 1)):
        patch = sparse_patch(name, new, prev)
        assert patch is not None and torch.equal(patch[1], torch.arange(10, dtype=torch.int32))
        assert torch.equal(patch[2], new)
    with pytest.raises(ValueError, match="floating-point"):
        sparse_patch("ids", torch.arange(4), None)


def test_vllms_request_types_accept_the_bodies() -> None:
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLWeightTransferUpdateInfo

    old = torch.zeros(4, 4, dtype=torch.bfloat16)
    new = old.clone()
    new[1, 2] = 1.0
    patches = [p for p in (sparse_patch("a", new, old), sparse_patch("b", new, None)) if p is not None]
    body = sparse_update_request(patches)
    info = SparseNCCLWeightTransferUpdateInfo(**body)
    assert info.num_updates_list == [1, 16] and info.dtype_names == ["bfloat16", "bfloat16"]
    assert info.shapes == [[4, 4], [4, 4]]
    init = NCCLWeightTransferInitInfo(**sparse_init_request("10.0.0.1", 29500, 1, 9))
    assert (init.rank_offset, init.world_size, init.packed) == (1, 9, False)
