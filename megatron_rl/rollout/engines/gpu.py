"""vLLM's `nccl` and `ipc` weight-transfer engines, counting what each worker loads.

Registered (`engines.register`) as `mrl_nccl` and `mrl_ipc`; the wire format is vLLM's own, so the
trainer side (`sync/gpu.py`) speaks to them exactly as to `nccl` / `ipc`. The additions:

- each worker counts the tensors it received in the current update and, once it finished,
  records them with the version the trainer then commits (`WorkerExtension.mrl_commit_version`), so
  the trainer checks every worker's own report as with the CPU backend (in a sparse round, the
  tensors its updates named: upstream's sparse receive drops what its patch loader says it
  loaded, so whether each patch landed is for the log-prob gate and `/weight_checker` to see);
  and, armed by a failed verification (`digest.py`), each checksums what it received;
- `mrl_nccl` also takes a delta sync's rounds in vLLM's `sparse_nccl` format: an update whose info
  carries `num_updates_list` is received by vLLM's own sparse receive (int32 indices, then values,
  per tensor; `SparseNCCLWeightTransferEngine.receive_weights`) and applied in place through vLLM's
  patch loader, without the layer-wise reload (that loader's contract). A server runs one engine
  for its life, and vLLM's `sparse_nccl` has no whole-tensor path, which the first sync, a
  restarted server's and every `rollout.sync_dense_every`-th need: so one engine takes both, the
  kind decided by a round's first update (a round is one kind or the other; mixing is refused).
  Patches land in the live weights, so they are refused where vLLM keeps experts in a layout of
  its own (`in_place_refusal`; the servers ask for its Triton MoE kernels, `RolloutServer.command`).
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


IN_PLACE_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")
"""vLLM's unquantized MoE kernels that keep the experts in the checkpoint's layout
(`fused_moe/oracle/unquantized.py` `convert_to_unquantized_kernel_format`): FlashInfer TRTLLM
re-lays them out in blocks and FlashInfer CUTLASS swaps the gate and up halves, in the live tensors."""


def in_place_refusal(model: Any) -> str | None:
    """Why a patch written in checkpoint coordinates into this model's live weights would land in
    the wrong elements, or None. vLLM's patch loader writes through each parameter's weight loader
    and does not re-run `process_weights_after_loading` (a dense round's layer-wise reload does),
    so the experts must be kept as loaded."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, FusedMoEMethodBase):
            continue
        backend = getattr(method, "unquantized_backend", None)
        if backend is None:          # quantized experts, or LoRA's MoE wrapper (which ignores --moe-backend)
            return f"{name}: experts not on vLLM's Triton MoE kernels ({type(method).__name__})"
        if backend.name not in IN_PLACE_MOE_BACKENDS:
            return f"{name}: vLLM's {backend.value} MoE kernel keeps the experts in a layout of its own"
    return None


class CountingNcclEngine(NCCLWeightTransferEngine):
    """vLLM's `nccl` engine, counting, and taking `sparse_nccl` rounds (see the module's note)."""

    update_info_cls = NcclUpdateInfo
    received = 0
    sparse: bool | None = None
    """This round's kind (None: no update yet)."""
    refusal: str | None = None
    """`in_place_refusal` of this engine's model ('' none), once it was asked."""

    def start_weight_update(self) -> None:
        # The layer-wise reload is entered by the first whole update: a sparse round must not.
        self.received, self.sparse = 0, None

    def receive_weights(self, update_info: NcclUpdateInfo) -> None:  # type: ignore[override]
        first = self.sparse is None
        self.sparse = round_kind(self.sparse, update_info)
        if self.sparse and first:
            self._check_in_place()
        with loads_recorded(self.model):
            if self.sparse:
                info = SparseNCCLWeightTransferUpdateInfo(**asdict(update_info))
                SparseNCCLWeightTransferEngine.receive_weights(self, info)  # type: ignore[arg-type]
            else:
                if first:
                    super().start_weight_update()         # vLLM's: initialize_layerwise_reload
                super().receive_weights(update_info)
        self.received += len(update_info.names)

    def _check_in_place(self) -> None:
        """Refuse a sparse round before its broadcast where it would corrupt the weights; once per
        engine. A backstop: megatron-rl's trainer asks first (`WorkerExtension.mrl_in_place_refusal`)
        and sends such a server whole rounds only, because a refusal raised here leaves a TP > 1
        server's workers' replies out of step (restart it after one)."""
        if self.refusal is None:
            self.refusal = in_place_refusal(self.model) or ""
        if self.refusal:
            raise RuntimeError(f"mrl_nccl: a sparse_nccl delta round would corrupt {self.refusal}. Start the server "
                               "with --moe-backend triton (megatron-rl's servers are, for nccl with "
                               "rollout.sync_delta on or auto) or set rollout.sync_delta: off; restart this server")

    def finish_weight_update(self) -> None:
        if self.sparse is False:
            super().finish_weight_update()                # vLLM's: finalize_layerwise_reload
        LOADED.update(version=None, tensors=self.received, moe_layers_repacked=0)
        self.sparse = None


class CountingIpcEngine(_Counting, IPCWeightTransferEngine):
    pass
