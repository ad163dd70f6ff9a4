"""vLLM's `nccl` and `ipc` weight-transfer engines, counting what each worker loads.

Registered (`engines.register`) as `mrl_nccl` and `mrl_ipc`; the wire format is vLLM's own, so the
trainer side (`sync/gpu.py`) speaks to them exactly as to `nccl` / `ipc`. The only
addition: each worker counts the tensors it received in the current update and, once it finished,
records them with the version the trainer then commits (`WorkerExtension.mrl_commit_version`), so
the trainer checks every worker's own report as with the CPU backend; and, armed by a failed
verification (`digest.py`), each checksums what it received.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

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


class CountingNcclEngine(_Counting, NCCLWeightTransferEngine):
    pass


class CountingIpcEngine(_Counting, IPCWeightTransferEngine):
    pass
