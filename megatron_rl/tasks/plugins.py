"""Find tasks and rewards named in a recipe: a built-in name or a Python path.

`task:` is a built-in task name (`BUILTIN_TASKS`), a module path whose module defines `TASK`
(`my_project.tasks.triage`), or `module.path:attribute`. A key of `rewards.weights` is a
registered reward name (`megatron_rl.rewards.REWARDS`: the generic ones and every built-in task's,
which register when the task's module is imported) or `module.path:function`.

Everything is resolved when the recipe is checked (`megatron-rl recipe validate`, and `train`
before any model or server starts); every failure is a `PluginError` that names the path and says
what was expected.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Mapping
from typing import Any

from ..registry import Registry
from ..rewards import UnknownRewardError, available_rewards, get_reward
from .task import LoadedTask, RewardFn, Task

# A built-in task is found by the same path lookup as a user's: name → the module holding its TASK.
BUILTIN_TASKS: Registry[str] = Registry("built-in task", {
    "mcq": "megatron_rl.tasks.mcq.task",
    "igakuqa": "megatron_rl.tasks.igakuqa.task",
    "medmcqa": "megatron_rl.tasks.medmcqa.task",
})
TASK_ATTRIBUTE = "TASK"


def load_builtin_tasks() -> None:
    """Import every built-in task, which registers its rewards, so a recipe may name any of them
    (e.g. `medmcqa_strict` with `task: mcq`)."""
    for _, path in BUILTIN_TASKS.items():
        importlib.import_module(path)


class PluginError(ValueError):
    """A task or reward named in the recipe cannot be loaded; the message names its path."""


def load_object(path: str, what: str, default_attribute: str | None = None) -> Any:
    """The object at `module.path:attribute` (or `module.path`'s `default_attribute`)."""
    module_name, sep, attribute = path.partition(":")
    if not sep:
        attribute = default_attribute or ""
    if not module_name or not attribute:
        raise PluginError(f"{what} {path!r}: expected 'module.path:name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import error of any kind inside the user's module
        raise PluginError(f"{what} {path!r}: cannot import module {module_name!r} "
                          f"({type(exc).__name__}: {exc})") from exc
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what} {path!r}: module {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    return obj


def check_reward(fn: Any, path: str) -> RewardFn:
    """`fn` must be callable as `fn(response, sample)`."""
    if not callable(fn):
        raise PluginError(f"reward {path!r}: is a {type(fn).__name__}, not a function "
                          "(response: str, sample) -> float")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):       # some C callables have no signature to check
        return fn
    try:
        signature.bind("", {})
    except TypeError as exc:
        raise PluginError(f"reward {path!r}: signature {signature} cannot be called as "
                          f"(response: str, sample) -> float ({exc})") from None
    return fn


def check_weight(name: str, weight: object) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise PluginError(f"weight of reward {name!r} must be a finite number, got {weight!r}")
    return float(weight)


def reward_function(name: str) -> RewardFn:
    """A registered reward, or the function at `module.path:function`."""
    if ":" in name:
        return check_reward(load_object(name, "reward"), name)
    load_builtin_tasks()
    try:
        return get_reward(name)
    except UnknownRewardError:
        raise PluginError(f"unknown reward {name!r}; allowed: {', '.join(available_rewards())}, "
                          "or a function as 'module.path:function'") from None


def load_task_spec(spec: str) -> Task:
    """The `Task` named by a built-in name, a module path (its `TASK`) or `module.path:attribute`."""
    path = BUILTIN_TASKS.get(spec) if spec in BUILTIN_TASKS else spec
    obj = load_object(path, "task", default_attribute=TASK_ATTRIBUTE)
    if not isinstance(obj, Task):
        where = path if ":" in path else f"{path}:{TASK_ATTRIBUTE}"
        raise PluginError(f"task {spec!r}: {where} is a {type(obj).__name__}, not a megatron_rl.tasks.Task "
                          f"(built-in tasks: {', '.join(BUILTIN_TASKS.names())})")
    return obj


def resolve_task(spec: str, weights: Mapping[str, float]) -> LoadedTask:
    """The task plus its reward functions: the recipe's `weights`, or the task's when empty."""
    task = load_task_spec(spec)
    chosen = dict(weights) if weights else dict(task.rewards)
    if not chosen:
        raise PluginError(f"task {spec!r} defines no rewards and the recipe sets no rewards.weights")
    functions = {name: reward_function(name) for name in chosen}
    return LoadedTask(task, {k: check_weight(k, v) for k, v in chosen.items()}, functions)


def plugin_problems(spec: str, weights: Mapping[str, float]) -> list[tuple[str, str]]:
    """Every (recipe key, message) that keeps the task or a reward from loading."""
    try:
        task = load_task_spec(spec)
    except PluginError as exc:
        return [("task", str(exc))]
    problems = []
    for name, weight in (weights or task.rewards).items():
        try:
            reward_function(name)
            check_weight(name, weight)
        except PluginError as exc:
            problems.append((f"rewards.weights.{name}", str(exc)))
    return problems
