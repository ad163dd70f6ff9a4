"""Megatron's torch gated-delta-rule kernel vs a naive per-token recurrence (float64).

Run as a plain script; prints one JSON line {"max_diff", "max_abs_out"}.
"""

from __future__ import annotations

import json

import torch

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # megatron.core imports need the CPU patches (triton-free MoE ops)

from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule  # noqa: E402


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """[b, s, h, d] inputs; one state S [d_k, d_v] per (batch, head), updated token by token."""
    b, s, h, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64)
    out = torch.empty(b, s, h, v.shape[-1], dtype=torch.float64)
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        k_t, v_t, b_t = k[:, t], v[:, t], beta[:, t][..., None]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, b_t * (v_t - predicted))
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] / dk ** 0.5, state)
    return out


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    b, s, h, dk, dv = 2, 150, 3, 64, 32
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    # As GatedDeltaNet feeds it: unit-norm q and k, decay g = −A·softplus(·) < 0, β = sigmoid(·).
    q = cpu_compat.l2norm(rand(b, s, h, dk))
    k = cpu_compat.l2norm(rand(b, s, h, dk))
    v = 10 * rand(b, s, h, dv)   # outputs O(1)
    g = -torch.rand(b, s, h, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.sigmoid(rand(b, s, h))
    got, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta)
    want = naive(q, k, v, g, beta)
    print(json.dumps({"max_diff": (got.double() - want).abs().max().item(), "max_abs_out": want.abs().max().item()}))


if __name__ == "__main__":
    main()
