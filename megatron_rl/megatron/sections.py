"""The tag by which a module names the sections of a fused parameter that megatron splits over TP
separately (read by `weights/sharding.py`, set by providers, e.g. Gated DeltaNet's in_proj)."""

TP_SECTIONS_ATTR = "tp_split_sections"
"""Parameter attribute: this rank's section sizes along `partition_dim` (each section TP-split)."""

GDN_SHARDED_KEYS = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
"""Local name prefix → TE name prefix in a Gated DeltaNet layer, where TE fuses the input norm into
in_proj (the Qwen3-Next provider's checkpoint keys, and the weight map's TE aliases)."""

LORA_PARAM_ATTR = "lora_adapter"
"""Parameter attribute: a LoRA adapter weight (`lora.py`), no weight of the base model: the weight
map, HF loading and full weight sync skip it."""
