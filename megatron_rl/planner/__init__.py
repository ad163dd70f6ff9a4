"""Memory and layout planner: exact parameter counts, per-GPU memory, layouts that fit.

Pure Python (standard library only): `megatron-rl plan` must answer in a second on a login node,
without torch. `params` counts parameters from an HF config dict, `memory` turns a recipe's layout
into GB per GPU, `plan` gives the verdict and searches for layouts that fit.
"""

from .params import ModelParams, PlannerError, count_params

__all__ = ["ModelParams", "PlannerError", "count_params"]
