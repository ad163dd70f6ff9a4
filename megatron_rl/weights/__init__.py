"""HF ↔ Megatron weights: one adapter per HF architecture, shared by conversion and weight sync."""
