"""Evaluation that belongs to no one task: accuracy of single-answer MCQ predictions against the
prompt files they were generated from (`mcq.py`, `megatron-rl eval mcq`). A benchmark's own rules
and reports live with its task (e.g. `megatron_rl/tasks/igakuqa/`).
"""
