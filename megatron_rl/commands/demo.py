"""`megatron-rl demo`: the README's main job — a tiny GRPO run on CPU through a real vLLM server.

Builds (once, cached in .cache/demo) the task data, a locally trained tokenizer and a tiny
Qwen3-MoE with a short supervised warm-up, trains with recipes/tiny/grpo.yaml, then prints the run
dir and a start/end table and writes reward_curve.png into the run dir.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="tiny GRPO run on CPU with a real vLLM server (the README's main job)")
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny" / "grpo.yaml"))
    p.add_argument("overrides", nargs="*", help="dotted overrides for the recipe")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    from ..demo.prepare import prepare_demo_assets
    from .train import load_checked

    fields = yaml.safe_load((REPO / "recipes" / "tiny" / "base.yaml").read_text())["model"]["tiny"]
    prepare_demo_assets(REPO / ".cache" / "demo", fields)
    overrides = [f"logging.run_name=demo-{time.strftime('%Y%m%d-%H%M%S')}", *args.overrides]
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


def plot(run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["reward/mean"] for r in rows], label="reward (mean)")
    if "accuracy" in rows[0]:
        ax.plot(steps, [r["accuracy"] for r in rows], "--", label="accuracy")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1.05)
    ax.legend()
    ax.set_title("tiny GRPO on CPU (vLLM rollouts)")
    out = run_dir / "reward_curve.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
