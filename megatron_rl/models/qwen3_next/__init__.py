"""Qwen3NextForCausalLM: Gated DeltaNet / gated attention hybrid (`layers.py` says which layer is
which), MoE with a sigmoid-gated shared expert. `provider.py` builds it, `weights.py` maps it."""

PLANNER_SHAPES = {
    "Qwen3NextForCausalLM": dict(moe=True, hybrid=True, gated_attention=True, shared_expert=True),
}
