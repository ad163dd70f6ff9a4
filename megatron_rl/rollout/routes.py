"""Routed experts of rollout samples, in vLLM's format: per sample an array
[prompt_len + gen_len − 1, num_hidden_layers, topk] of expert ids (uint8 up to 256 experts,
uint16 above; dense layers' rows are 0), one row per token the engine forwarded (the last sampled
token never is).

Two sources:

* **From sampling** (GPU): the server runs with `--enable-return-routed-experts` and each
  `/v1/completions` choice carries its routes (base64 `.npy`), recorded by the forwards that
  produced the tokens. vLLM 0.32 serves this only from its Model Runner V2, which needs Triton.
* **Re-score** (CPU, where that runner cannot run): after the rollout, with the same weights (no
  sync in between), each sample's prompt + response minus its last token is prefilled once
  (`max_tokens` 1) while the worker extension records the top-k ids every MoE router computes
  (vLLM's own capture hook on its CPU router). Requests go one at a time with a fresh `cache_salt`,
  so no prefix-cache hit skips a token and the recorded rows are exactly that sample's, in order.

Routing is a function of the token prefix and the weights, so the re-scored routes are the
sampling routes up to floating-point differences between a prefill over the whole sequence and the
incremental decode steps that sampled it (different GEMM shapes and batch neighbours): tokens
whose top-k sits at a near-tie can flip. Replay then makes the trainer use the re-scored experts;
the `routing/mismatch_frac` metric measures how far the trainer's own router is from them.

Memory: num_hidden_layers × topk ids per token, 1 byte each (2 above 256 experts). Tiny MoE:
2 × 2 = 4 B/token. Qwen3-235B-A22B: 94 × 8 = 752 B/token, 6.2 MB per 8192-token sample.
Qwen3-Next-80B-A3B (512 experts): 48 × 10 × 2 = 960 B/token, 7.9 MB per 8192-token sample. Over
HTTP vLLM's base64 adds a third. The trainer keeps them in this compact form, on global rank 0 and
on the ranks that compute each sample, and expands one micro-batch at a time to the dense
[rows, width, layers, topk] with a 1-byte validity flag per token (`route_rows.py`).
"""

from __future__ import annotations

import base64
import io
import secrets
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import torch

if TYPE_CHECKING:
    from .server import RolloutServer


class RouteCaptureError(RuntimeError):
    """The routes the worker recorded do not add up to the requests sent."""


def decode_routes(encoded: str) -> np.ndarray:
    """vLLM's base64 `.npy` routes of one choice."""
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def encode_routes(routes: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, routes, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def compact_dtype(num_experts: int) -> np.dtype:
    """vLLM's id type: uint8 when every id fits, uint16 otherwise."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


# ---------------------------------------------------------------- worker side (inside vLLM)
class RouteRecorder:
    """Per-layer top-k ids of every forward since `start`, from vLLM's router capture hook."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.num_layers, self.num_experts = num_layers, num_experts
        self.routers: list[tuple[int, Any]] = []
        for module in model.modules():
            if isinstance(module, MoERunner):
                if not isinstance(module.router, BaseRouter):
                    raise RouteCaptureError(f"router {type(module.router).__name__} has no capture hook")
                self.routers.append((int(module.layer_id), module.router))
        if not self.routers:
            raise RouteCaptureError("the served model has no MoE router to record")
        self.chunks: dict[int, list[torch.Tensor]] = {}

    def start(self) -> None:
        self.chunks = {layer: [] for layer, _ in self.routers}
        for layer, router in self.routers:
            router.set_capture_fn(partial(self._capture, layer))

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.chunks[layer].append(topk_ids.detach().to("cpu", torch.int32, copy=True))

    def take(self) -> np.ndarray:
        """[tokens, num_layers, topk] in forward order; the hooks are removed."""
        for _, router in self.routers:
            router.set_capture_fn(None)
        per_layer = {layer: torch.cat(c) if c else None for layer, c in self.chunks.items()}
        self.chunks = {}
        lengths = {layer: 0 if t is None else t.shape[0] for layer, t in per_layer.items()}
        if len(set(lengths.values())) != 1:
            raise RouteCaptureError(f"layers recorded different token counts: {lengths}")
        first = next(t for t in per_layer.values() if t is not None) if any(lengths.values()) else None
        rows, topk = (0, 0) if first is None else first.shape
        out = np.zeros((rows, self.num_layers, topk), dtype=compact_dtype(self.num_experts))
        for layer, t in per_layer.items():
            if t is not None:
                out[:, layer] = t.numpy()
        return out


# ---------------------------------------------------------------- client side
def rescore_routes(server: RolloutServer, sequences: Sequence[list[int]], timeout_s: float = 600.0) -> list[np.ndarray]:
    """Routes of each full sequence (prompt + response), re-scored on `server` as the module
    docstring says; `len(seq) − 1` rows each. Nothing else may be generating on that server."""
    if server.cfg.data_parallel_size > 1:
        raise RouteCaptureError("re-scored routes need one engine per server (rollout.data_parallel_size 1): "
                                "requests would be spread over engines whose workers record separately")
    server.rpc("mrl_routes_start")
    headers = {"Authorization": f"Bearer {server.token}"}
    rows: list[int] = []
    try:
        with httpx.Client(timeout=timeout_s) as client:
            for seq in sequences:
                if len(seq) < 2:
                    rows.append(0)
                    continue
                body = {"model": "policy", "prompt": list(seq[:-1]), "max_tokens": 1, "temperature": 0.0,
                        "cache_salt": secrets.token_hex(8)}
                resp = client.post(server.base_url + "/v1/completions", json=body, headers=headers)
                if resp.status_code != 200:
                    raise RouteCaptureError(f"re-score request: HTTP {resp.status_code}: {resp.text[:300]}")
                rows.append(len(seq) - 1)
    finally:
        results = server.rpc("mrl_routes_take")
    routes = decode_routes(results[0])
    if routes.shape[0] != sum(rows):
        raise RouteCaptureError(f"the worker recorded {routes.shape[0]} token rows for {sum(rows)} re-scored tokens "
                                "(another request ran on the server meanwhile?)")
    bounds = np.cumsum([0, *rows])
    return [routes[a:b] for a, b in zip(bounds, bounds[1:])]


def attach_routes(servers: Sequence[RolloutServer], groups: Sequence[Any]) -> int:
    """Give every sample of `groups` (RolloutGroups) its routes: those the server returned from
    sampling stay; the others are re-scored on the first server (all hold the same weights until
    the next sync). Returns how many were re-scored."""
    missing = [s for g in groups for s in g.samples if s.routed_experts is None]
    if missing:
        routes = rescore_routes(servers[0], [s.prompt_ids + s.response_ids for s in missing])
        for sample, r in zip(missing, routes):
            sample.routed_experts = r
    return len(missing)


def routes_batch(routes: Sequence[np.ndarray | None], seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The dense form of a batch's routes, [N, seq_len, num_layers, topk] (uint8 as vLLM's, int16
    for vLLM's uint16), and their flags [N, seq_len]: row i's token t has the route `routes[i][t]`
    where recorded; the last token, pads and samples without routes are not valid (the trainer
    routes them itself). None when no sample has routes.

    The trainer no longer builds this for a whole step (N × seq_len on every rank: audit-2 #15);
    it is the reference that `route_rows.RouteRows.dense` equals one micro-batch at a time."""
    first = next((r for r in routes if r is not None), None)
    if first is None:
        return None
    num_layers, topk = first.shape[1], first.shape[2]
    # torch has few uint16 kernels; int16 holds every id of up to 32768 experts (checked below).
    dtype = torch.uint8 if first.dtype == np.uint8 else torch.int16
    out = torch.zeros(len(routes), seq_len, num_layers, topk, dtype=dtype)
    valid = torch.zeros(len(routes), seq_len, dtype=torch.bool)
    for i, r in enumerate(routes):
        if r is None:
            continue
        if r.ndim != 3 or r.shape[1] != num_layers or r.shape[2] != topk:
            raise ValueError(f"sample {i}: routes of shape {tuple(r.shape)}, expected [tokens, {num_layers}, {topk}]")
        n = min(r.shape[0], seq_len)
        ids = torch.from_numpy(r[:n].astype(np.int64))
        if ids.numel() and int(ids.max()) > torch.iinfo(dtype).max:
            raise ValueError(f"sample {i}: expert id {int(ids.max())} does not fit {dtype}")
        out[i, :n] = ids.to(dtype)
        valid[i, :n] = True
    return out, valid
