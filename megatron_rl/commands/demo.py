"""`megatron-rl demo`: the README's main job — a tiny GRPO run on CPU through a real vLLM server.

Builds (once, cached in .cache/demo, or $MEGATRON_RL_CACHE/demo) the task data, a locally trained
tokenizer and a tiny Qwen3-MoE with a short supervised warm-up, trains with recipes/tiny/grpo.yaml,
then prints the run dir and a start/end table and writes reward_curve.png into the run dir.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CACHE_ENV = "MEGATRON_RL_CACHE"
"""Where the demo's (and the tests') built assets go instead of the checkout's .cache: a fresh,
empty cache, or a writable one beside a read-only install (containers/selftest.py sets it)."""


def cache_root(repo: Path = REPO, env: Mapping[str, str] = os.environ) -> Path:
    """$MEGATRON_RL_CACHE, else the checkout's .cache when it can be written, else one under
    $TMPDIR: inside the image the checkout is the read-only /opt/megatron-rl."""
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    try:
        (repo / ".cache").mkdir(exist_ok=True)
        with tempfile.TemporaryFile(dir=repo / ".cache"):
            return repo / ".cache"
    except OSError:
        return Path(env.get("TMPDIR") or tempfile.gettempdir()) / "megatron-rl-cache"


def asset_overrides() -> list[str]:
    """The demo's assets, built once into `cache_root()`, as recipe overrides: the built files by
    their paths, wherever the cache is (the tiny recipes' relative paths assume the checkout's .cache)."""
    import yaml

    from ..demo.prepare import prepare_demo_assets

    fields = yaml.safe_load((REPO / "recipes" / "tiny" / "base.yaml").read_text())["model"]["tiny"]
    assets = prepare_demo_assets(cache_root() / "demo", fields)
    return [f"model.init_checkpoint={assets['model']}", f"data.train_path={assets['train']}",
            f"data.eval_path={assets['eval']}"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="tiny GRPO run on CPU with a real vLLM server (the README's main job)")
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny" / "grpo.yaml"))
    p.add_argument("overrides", nargs="*", help="dotted overrides for the recipe")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..config.check import load_checked

    overrides = [*asset_overrides(), f"logging.run_name=demo-{time.strftime('%Y%m%d-%H%M%S')}", *args.overrides]
    cfg = load_checked(args.recipe, overrides)
    if cfg is None:
        return 1
    from ..megatron import cpu_compat

    cpu_compat.apply()   # before the trainer imports megatron-core
    from ..train.loop import train

    started = time.time()
    run_dir = train(cfg)
    summary = summarize(run_dir / "metrics.jsonl")
    print(f"\nrun dir: {run_dir.resolve()}  ({time.time() - started:.0f}s)")
    print(table(summary))
    print(f"reward curve: {plot(run_dir)}")
    return 0


def summarize(path: Path, window: int = 3) -> dict[str, tuple[float, float]]:
    """Mean of the first and the last `window` steps, per headline metric."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keys = ("reward/mean", "accuracy", "format_rate", "response_length/mean")
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    return {k: (mean(rows[:window], k), mean(rows[-window:], k)) for k in keys if k in rows[0]}


def table(summary: dict[str, tuple[float, float]]) -> str:
    lines = ["| metric | start | end |", "|---|---|---|"]
    lines += [f"| {k} | {a:.3f} | {b:.3f} |" for k, (a, b) in summary.items()]
    return "\n".join(lines)


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and up to `window - 1` before it (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(run_dir: Path, window: int = 10) -> Path:
    """reward_curve.png in the run dir (`reward_figure`)."""
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig = reward_figure(rows, window)
    out = run_dir / "reward_curve.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def reward_figure(rows: list[dict], window: int = 10) -> Any:
    """The per-step mean reward, its rolling mean over `window` steps, the sampled accuracy and the
    periodic greedy eval accuracy (one point per step the run evaluated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    rewards = [r["reward/mean"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, alpha=0.35, label="reward (mean)")
    ax.plot(steps, rolling_mean(rewards, window), label=f"reward ({window}-step rolling mean)")
    if "accuracy" in rows[0]:
        ax.plot(steps, [r["accuracy"] for r in rows], "--", alpha=0.6, label="accuracy (sampled)")
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if evals:
        ax.plot(*zip(*evals), "o", label="eval accuracy (greedy)")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="small")
    ax.set_title("tiny GRPO on CPU (vLLM rollouts)")
    fig.tight_layout()
    return fig
