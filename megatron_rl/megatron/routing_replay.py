"""R3 routing replay: the actor's MoE routers use the experts the rollout engine chose.

The batch carries, per row, the top-k expert ids of every token and every decoder layer
(`TrainBatch.routes`, compact per sample: `route_rows.py`). Each micro-batch is expanded to
[b, s, num_hidden_layers, topk] (uint8 up to 256 experts, int16 above) with a flag per token saying
whether a route was recorded ([b, s]) just before it is fed (`feed`). Rows of layers that are dense
hold anything; only MoE layers are read.

megatron-core 0.19's `RouterReplay` replays whole micro-batches and keeps one global list of
routers per process. Both are the wrong shape here:

* tokens without a recorded route (padding, the last token — vLLM never forwards the token it
  sampled last —, prompts cut by the server, CHORD's expert rows) must be routed by the trainer's
  own router. `TokenReplay` takes the recorded ids where a route exists and the live top-k
  elsewhere, per token;
* a reference model and the policy live in the same process, and tests build many actors: each
  actor attaches its own `TokenReplay` to its own routers and keeps them out of the global list.

With activation recompute, a checkpointed layer's router runs again in backward, when later
micro-batches have been fed already (pipeline 1F1B). Each router keeps the routes of its forwards
in order and the recompute (a forward inside the autograd engine) takes them back first in first
out, as megatron-core's own REPLAY_BACKWARD list does; backward runs in forward order per layer.

Every replayed or measured forward also counts the tokens whose live top-k (as a set) differs
from the recorded one: `routing/mismatch_frac`, the share that would be routed differently
without replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import cpu_compat

cpu_compat.require_applied()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay  # noqa: E402

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class TokenReplay(RouterReplay):
    """One router's replay: recorded ids where a token has a route, live top-k elsewhere.

    `replay` False only measures (the forward routes as usual). Set per micro-batch with
    `set_tokens`; `mismatch` and `counted` accumulate over micro-batches until `reset_counts`."""

    def __init__(self, layer_number: int) -> None:
        super().__init__()
        # Not the process-wide list: this instance belongs to one actor (see module docstring).
        RouterReplay.global_router_replay_instances.remove(self)
        self.layer_number = layer_number
        self.ids: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.replay = False
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        """Routes of this step's forwards awaiting their recompute in backward (full recompute)."""
        self.log: list[torch.Tensor] | None = None
        """When a list: the ids every forward used, per call, on the CPU (tests, diagnostics)."""
        self.recompute_log: list[torch.Tensor] | None = None
        """The same for recomputes in backward."""
        self.mismatch: torch.Tensor | int = 0
        self.counted: torch.Tensor | int = 0

    def set_tokens(self, ids: torch.Tensor | None, valid: torch.Tensor | None, replay: bool) -> None:
        """`ids` [tokens, topk] int64 and `valid` [tokens] bool, in the router's row order."""
        self.ids, self.valid, self.replay = ids, valid, replay

    def reset_counts(self) -> None:
        self.mismatch, self.counted = 0, 0

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: TopK | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None, "megatron-core passes its top-k"
        probs, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recompute = self.pending is not None and _in_backward()
        if recompute:
            assert self.pending, f"layer {self.layer_number}: a recompute without a pending forward"
            ids, valid = self.pending.pop(0)
        elif self.ids is None or self.valid is None:
            self._log(live, False)
            return probs, live
        else:
            ids, valid = self.ids, self.valid
            if self.pending is not None:
                self.pending.append((ids, valid))
        ids, valid = ids.to(scores.device), valid.to(scores.device)
        if ids.shape[0] != scores.shape[0]:
            raise RuntimeError(f"layer {self.layer_number}: {ids.shape[0]} recorded routes for "
                               f"{scores.shape[0]} router tokens (sequence-parallel slicing out of step)")
        if not recompute:
            self._count(live, ids, valid)
        chosen = torch.where(valid.unsqueeze(1), ids, live) if self.replay else live
        self._log(chosen, recompute)
        return (scores.gather(1, chosen), chosen) if self.replay else (probs, live)

    def _count(self, live: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> None:
        with torch.no_grad():
            differs = (live.sort(dim=1).values != ids.sort(dim=1).values).any(dim=1) & valid
            # Kept on the device (no sync per layer); read once per step by `take_metrics`.
            self.mismatch = self.mismatch + differs.sum()
            self.counted = self.counted + valid.sum()

    def _log(self, ids: torch.Tensor, recompute: bool) -> None:
        log = self.recompute_log if recompute else self.log
        if log is not None:
            log.append(ids.detach().cpu())


def _in_backward() -> bool:
    """Inside the autograd engine: a checkpointed layer's recompute (megatron-core's and
    Transformer Engine's checkpoints both re-run the forward from the backward pass)."""
    return bool(torch._C._current_graph_task_id() != -1)


def _topk_routers(model: torch.nn.Module) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "router_replay") and hasattr(m, "layer_number")]


class RoutingReplay:
    """The replay of one actor's model: its routers, the per-micro-batch feed and the counts."""

    def __init__(self, model: torch.nn.Module, config: Any) -> None:
        if getattr(config, "moe_router_fusion", False):
            raise ValueError("routing replay needs moe_router_fusion=False: the fused router skips the replay hook")
        self.config = config
        self._weight = next(model.parameters())
        """Where the model is (a parameter object survives `.to()`): where the routes go."""
        self.routers: list[TokenReplay] = []
        for router in _topk_routers(model):
            if getattr(router, "routing_type", "none") in ("sinkhorn", "quantile_balancing"):
                raise ValueError(f"routing replay does not apply to {router.routing_type!r} routing")
            router.router_replay = TokenReplay(int(router.layer_number))
            self.routers.append(router.router_replay)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] → this rank's router rows [s_local·b, ...]: s-major then b, the
        sequence-parallel slice of s when SP splits the sequence over TP ranks."""
        if ps.get_context_parallel_world_size() > 1:
            raise NotImplementedError("routing replay with context parallelism (the actor does not split "
                                      "sequences by CP yet)")
        tp = ps.get_tensor_model_parallel_world_size()
        if self.config.sequence_parallel and tp > 1:
            s = t.shape[1] // tp
            rank = ps.get_tensor_model_parallel_rank()
            t = t[:, rank * s:(rank + 1) * s]
        return t.transpose(0, 1).reshape(-1, *t.shape[2:])

    def feed(self, routes: torch.Tensor | None, valid: torch.Tensor | None, replay: bool,
             recompute: bool = False) -> None:
        """One micro-batch's routes [b, s, layers, topk] and flags [b, s] (the micro-batch's
        token shape), or None: the routers route on their own and count nothing. `recompute`:
        backward will re-run the routers (full recompute); keep the routes for it until `clear`."""
        if routes is not None and valid is not None and self._weight.device.type == "cuda":
            # One asynchronous copy of the micro-batch's routes from pinned memory, instead of a
            # blocking pageable one per MoE layer inside each router (94 a forward for the 235B:
            # audit 3 #8). The caching host allocator keeps the pinned source until the copy is done.
            device = self._weight.device
            routes = routes.pin_memory().to(device, non_blocking=True)
            valid = valid.pin_memory().to(device, non_blocking=True)
        for r in self.routers:
            if routes is None or valid is None:
                r.set_tokens(None, None, False)
                continue
            if recompute and r.pending is None:
                r.pending = []
            layer = r.layer_number - 1                # megatron's global 1-based number → vLLM's layer id
            if layer >= routes.shape[2]:
                raise ValueError(f"routes cover {routes.shape[2]} layers; the model routes at layer {layer}")
            r.set_tokens(self._rows(routes[:, :, layer].long()), self._rows(valid.bool()), replay)

    def clear(self) -> None:
        for r in self.routers:
            r.set_tokens(None, None, False)
            r.pending = None

    def take_metrics(self, num_layers: int, per_layer: bool) -> dict[str, float]:
        """`routing/mismatch_frac` over every rank's counted tokens since the last call (each
        token once: TP ranks without SP route the same tokens, only TP rank 0 counts them), and
        per layer on request. The counts are reset. Every rank must call this (a collective)."""
        counts = torch.zeros(num_layers, 2, dtype=torch.float64)
        dedup = self.config.sequence_parallel or ps.get_tensor_model_parallel_rank() == 0
        for r in self.routers:
            if dedup:
                counts[r.layer_number - 1] += torch.tensor([float(r.mismatch), float(r.counted)], dtype=torch.float64)
            r.reset_counts()
        # A CPU tensor: gloo takes it, and the GPU process group is "cpu:gloo,cuda:nccl".
        dist.all_reduce(counts)
        total = counts.sum(dim=0)
        out = {"routing/mismatch_frac": float(total[0] / total[1]) if total[1] > 0 else float("nan"),
               "routing/tokens": float(total[1])}
        if per_layer:
            for layer in range(num_layers):
                if counts[layer, 1] > 0:
                    out[f"routing/mismatch_frac/layer_{layer}"] = float(counts[layer, 0] / counts[layer, 1])
        return out

