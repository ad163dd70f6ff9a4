"""Which recipe changes a `--resume` may carry: a run dir holds one experiment.

A resume continues the checkpoint of the run dir's `recipe.resolved.yaml`. Resuming it under
another algorithm, model, task, reward or data set would train a new experiment from the old
one's state and log both into one `metrics.jsonl` (the Slurm job always passes `--resume`, so a
reused `logging.run_name` did that silently). So every key defines the experiment except the
ones listed here: how long the run goes, where it logs and checkpoints, where and how it runs
(Slurm, container, parallel layout — the checkpoint reshards), and how the rollout servers are
reached and watched (placement, ports, timeouts, transports: not what they sample).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from .loader import to_dict
from .schema import RecipeConfig

MAY_CHANGE: tuple[str, ...] = (
    "name",
    "trainer.max_steps", "trainer.epochs", "trainer.max_bad_steps_in_row", "trainer.collective_timeout_min",
    "logging", "checkpoint", "slurm", "container", "parallelism", "evaluation", "data.eval_path",
    "rollout.placement", "rollout.nodes", "rollout.tensor_parallel_size", "rollout.enable_expert_parallel",
    "rollout.data_parallel_size", "rollout.sleep_level", "rollout.gpu_memory_utilization",
    "rollout.enforce_eager", "rollout.host", "rollout.port", "rollout.max_concurrency",
    "rollout.request_timeout_s", "rollout.max_retries", "rollout.startup_timeout_s", "rollout.hang_timeout_s",
    "rollout.sync_bucket_mb", "rollout.weight_transfer", "rollout.verify_every", "rollout.verify_tolerance",
    "rollout.verify_failures_in_row",
    "rollout.cpu_kvcache_gb", "rollout.routing_replay_diagnostics",
)
"""Dotted keys (a section name covers all its keys) that may differ between a run dir's recipe
and the recipe resuming it."""


def may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE)


_FREE_FORM = ("rewards.weights", "model.tiny", "rollout.chat_template_kwargs")
"""The schema's free-form mappings: each compares as one value."""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} → {'a.b': 1}; lists, scalars and the free-form mappings are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and dotted not in _FREE_FORM:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def experiment_differences(saved: Mapping[str, Any], cfg: RecipeConfig) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) of every experiment-defining key whose value in the run dir's
    resolved recipe (`saved`, as read from YAML) differs from `cfg`'s, by key. A key the saved
    recipe lacks (the schema grew since) counts as its default; a key only the saved recipe has
    (since removed) is ignored."""
    # Through YAML, as the saved side went: tuples come back as lists, floats as the same floats.
    new = flatten(yaml.safe_load(yaml.safe_dump(to_dict(cfg))))
    default = flatten(to_dict(RecipeConfig()))
    old = flatten(saved)
    return [(k, old.get(k, default.get(k)), v) for k, v in sorted(new.items())
            if not may_change(k) and old.get(k, default.get(k)) != v]


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else "…" + text[-39:]


def refusal(run: str, differing: list[tuple[str, Any, Any]]) -> str:
    """The one-line error of a resume into another experiment's run dir."""
    shown = "; ".join(f"{k} ({_short(a)} -> {_short(b)})" for k, a, b in differing[:8])
    more = f" and {len(differing) - 8} more" if len(differing) > 8 else ""
    return (f"{run} holds another experiment: --resume would continue its checkpoint under a recipe that "
            f"differs in {shown}{more}; pick another logging.run_name for a new run (a resume may change only "
            f"{', '.join(MAY_CHANGE)})")
