"""Evaluation: the official IgakuQA scoring rule, reports, exact McNemar comparisons.

Submodules are imported by name (`megatron_rl.eval.scoring`, `.igakuqa_report`, `.stats`,
`.compare`); matplotlib is imported only when a comparison plot is drawn.
"""
