"""vLLM's `nccl` and `ipc` weight-transfer engines, counting what each worker loads.

Registered (`engines.register`) as `mrl_nccl` and `mrl_ipc`; the wire format is vLLM's own, so the
trainer side (`sync/gpu.py`) speaks to them exactly as to `nccl` / `ipc`. The additions:

- each worker counts the tensors it received in the current update and, once it finished,
  records them with the version the trainer then commits (`WorkerExtension.mrl_commit_version`), so
  the trainer checks every worker's own report as with the CPU backend; and, armed by a failed
  verification (`digest.py`), each checksums what it received;
- `mrl_nccl` also takes a delta sync's rounds in vLLM's `sparse_nccl` format: an update whose info
  carries `num_updates_list` is received by vLLM's own sparse receive (int32 indices, then values,
  per tensor; `SparseNCCLWeightTransferEngine.receive_weights`) and applied in place through vLLM's
  patch loader, without the layer-wise reload (that loader's contract). A server runs one engine
  for its life, and vLLM's `sparse_nccl` has no whole-tensor path, which the first sync, a
  restarted server's and every `rollout.sync_dense_every`-th need: so one engine takes both, the
  kind decided by a round's first update (a round is one kind or the other; mixing is refused).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.sparse_nccl_engine import (
    SparseNCCLWeightTransferEngine,
    SparseNCCLWeightTransferUpdateInfo,
)

from .digest import loads_recorded
from .loaded import LOADED


class _Counting:
    received = 0
    model: Any
    """The worker's model (vLLM's `WeightTransferEngine.__init__` sets it)."""

    def start_weight_update(self) -> None:
        super().start_weight_update()  # type: ignore[misc]
        self.received = 0

    def receive_weights(self, update_info: Any) -> None:
        with loads_recorded(self.model):
            super().receive_weights(update_info)  # type: ignore[misc]
        self.received += len(update_info.names)

    def finish_weight_update(self) -> None:
        super().finish_weight_update()  # type: ignore[misc]
        LOADED.update(version=None, tensors=self.received, moe_layers_repacked=0)


@dataclass
class NcclUpdateInfo(NCCLWeightTransferUpdateInfo):
    """vLLM's dense NCCL update info, or (with `num_updates_list`) its sparse one."""

    num_updates_list: list[int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_updates_list is not None:
            SparseNCCLWeightTransferUpdateInfo(**asdict(self))       # vLLM's own validation


def round_kind(current: bool | None, update_info: NcclUpdateInfo) -> bool:
    """Whether the round is sparse, from its first update (`current` None) on; a later update of
    the other kind is refused (the dense kind reloads layer-wise, the sparse one patches in place)."""
    sparse = update_info.num_updates_list is not None
    if current is not None and current != sparse:
        raise ValueError(f"mrl_nccl: a {'sparse' if sparse else 'whole'} update inside a "
                         f"{'sparse' if current else 'whole'} round (a round is one kind)")
    return sparse


class CountingNcclEngine(NCCLWeightTransferEngine):
    """vLLM's `nccl` engine, counting, and taking `sparse_nccl` rounds (see the module's note)."""

    update_info_cls = NcclUpdateInfo
    received = 0
    sparse: bool | None = None
    """This round's kind (None: no update yet)."""

    def start_weight_update(self) -> None:
        # The layer-wise reload is entered by the first whole update: a sparse round must not.
        self.received, self.sparse = 0, None

    def receive_weights(self, update_info: NcclUpdateInfo) -> None:  # type: ignore[override]
        first = self.sparse is None
        self.sparse = round_kind(self.sparse, update_info)
        with loads_recorded(self.model):
            if self.sparse:
                info = SparseNCCLWeightTransferUpdateInfo(**asdict(update_info))
                SparseNCCLWeightTransferEngine.receive_weights(self, info)  # type: ignore[arg-type]
            else:
                if first:
                    super().start_weight_update()         # vLLM's: initialize_layerwise_reload
                super().receive_weights(update_info)
        self.received += len(update_info.names)

    def finish_weight_update(self) -> None:
        if self.sparse is False:
            super().finish_weight_update()                # vLLM's: finalize_layerwise_reload
        LOADED.update(version=None, tensors=self.received, moe_layers_repacked=0)
        self.sparse = None


class CountingIpcEngine(_Counting, IPCWeightTransferEngine):
    pass
