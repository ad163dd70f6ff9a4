"""Tensor families: which part of the model an HF tensor name belongs to (attention o_proj, expert
down_proj, router, the Gated DeltaNet projections, ...), for messages that name what went wrong
(the weight-sync diagnosis, `sync/diagnose.py`). A pure function of the name, over the names of
every weight map (`models/<arch>/weights.py`; tests/unit/test_sync_diagnosis.py checks that each
of their names has a family).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

OTHER = "other"
"""The family of a name no rule knows."""

_LAYER = re.compile(r"^model\.layers\.\d+\.")
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), f) for p, f in (
    (r"^model\.embed_tokens\.weight$", "embeddings"),
    (r"^lm_head\.weight$", "lm_head"),
    (r"^model\.norm\.weight$", "final norm"),
    (r"^(input_layernorm|post_attention_layernorm)\.weight$", "layer norms"),
    (r"^self_attn\.([qkvo])_proj\.(weight|bias)$", "attention {0}_proj"),
    (r"^self_attn\.[qk]_norm\.weight$", "attention q/k norms"),
    (r"^mlp\.(gate|up|down)_proj\.weight$", "MLP {0}_proj"),
    (r"^mlp\.gate\.weight$", "router"),
    (r"^mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", "expert {0}_proj"),
    (r"^mlp\.shared_expert\.(gate|up|down)_proj\.weight$", "shared expert {0}_proj"),
    (r"^mlp\.shared_expert_gate\.weight$", "shared expert gate"),
    (r"^linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj|conv1d)\.weight$", "Gated DeltaNet {0}"),
    (r"^linear_attn\.(A_log|dt_bias)$", "Gated DeltaNet {0}"),
    (r"^linear_attn\.norm\.weight$", "Gated DeltaNet norm"),
))


def family(hf_name: str) -> str:
    """The family of one HF tensor name (`OTHER` when no rule matches)."""
    inner = _LAYER.sub("", hf_name, count=1)
    for pattern, name in _RULES:
        m = pattern.match(inner)
        if m:
            return name.format(*m.groups())
    return OTHER


def by_family(names: Iterable[str]) -> dict[str, list[str]]:
    """`names` grouped by family, families in order of their first name, names in given order."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(family(n), []).append(n)
    return out
