"""Tasks as plugins: prompt format + reward functions (+ eval scorer), named in the recipe.

    task: my_project.triage            # a module with TASK = Task(...), or module.path:attr
    rewards:
      weights:
        mcq_answer: 1.0                # a registered reward
        my_project.rewards:brevity: 0.2  # or any function (response, sample) -> float
"""

from .plugins import (
    BUILTIN_TASKS,
    PluginError,
    load_builtin_tasks,
    load_task_spec,
    plugin_problems,
    resolve_task,
    reward_function,
)
from .task import LoadedTask, RewardFn, Task, stored_messages

__all__ = [
    "BUILTIN_TASKS",
    "LoadedTask",
    "PluginError",
    "load_builtin_tasks",
    "RewardFn",
    "Task",
    "load_task_spec",
    "plugin_problems",
    "resolve_task",
    "reward_function",
    "stored_messages",
]
