"""`megatron-rl train RECIPE [key.path=value ...] [--resume]`."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run RL training from a recipe (rollout server started automatically)")
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6 rollout.n=16")
    p.add_argument("--resume", action="store_true",
                   help="continue the run dir (logging.output_dir/logging.run_name) from its latest checkpoint")
    p.set_defaults(func=run)


def load_checked(path: str, overrides: list[str]):  # noqa: ANN201  (RecipeConfig | None)
    """Load + lint; print problems and return None when the recipe cannot run."""
    from ..config import ConfigError, load_recipe
    from ..lint import lint

    try:
        cfg = load_recipe(path, overrides)
    except ConfigError as exc:
        print(f"error: invalid recipe {path}", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return None
    findings = lint(cfg)
    for f in findings:
        print(f"  {f}", file=sys.stderr)
    if any(f.level == "error" for f in findings):
        print(f"error: {path} has lint errors (see above)", file=sys.stderr)
        return None
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = load_checked(args.recipe, args.overrides)
    if cfg is None:
        return 1
    from ..megatron import cpu_compat
    from ..slurm.render import gpus_expected

    # Before anything is built: a GPU recipe must not quietly train on the CPU.
    problem = cpu_compat.cuda_problem(gpus_expected(cfg))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    cpu_compat.apply()   # before the trainer imports megatron-core
    from ..train.loop import train
    from ..train.session import Stop

    try:
        run_dir = train(cfg, resume=args.resume)
    except (Stop, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"run dir: {run_dir}")
    return 0
