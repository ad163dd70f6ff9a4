"""Qwen3ForCausalLM (dense) and Qwen3MoeForCausalLM: one weight map (`weights.py`), two providers
(`provider.py`). Layer pattern: every layer is attention + MLP; the MLP is MoE where
`model_config.moe_layers` says so (`mlp_only_layers`, `decoder_sparse_step`)."""

PLANNER_SHAPES = {
    "Qwen3ForCausalLM": dict(moe=False, hybrid=False, gated_attention=False, shared_expert=False),
    "Qwen3MoeForCausalLM": dict(moe=True, hybrid=False, gated_attention=False, shared_expert=False),
}
