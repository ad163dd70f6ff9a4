"""Evaluation: the IgakuQA scoring rules (the benchmark's own by default), reports, exact McNemar
comparisons, and multi-system tables in the published layouts.

Submodules are imported by name (`megatron_rl.eval.scoring`, `.igakuqa_report`, `.stats`,
`.compare`, `.table`); matplotlib is imported only when a plot is drawn.
"""
