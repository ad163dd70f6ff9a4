"""`megatron-rl recipe validate|show PATH [key.path=value ...]`."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import RecipeConfig


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("recipe", help="validate or show a recipe")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb, helptext in (("validate", "type-check and lint a recipe (exit 0 = no errors)"),
                           ("show", "print the fully resolved recipe as YAML")):
        p = verbs.add_parser(verb, help=helptext)
        p.add_argument("path", help="recipe YAML file")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6 rollout.n=16")
        p.add_argument("--no-check-paths", action="store_true",
                       help="do not require that files named in the recipe exist (cluster paths)")
        p.set_defaults(func=run)


def schedule_comment(cfg: RecipeConfig) -> str:
    """What the counts mean, as YAML comments after the resolved recipe (`megatron_rl.schedule`)."""
    from ..schedule import run_schedule

    schedule = run_schedule(cfg)
    if schedule is None:
        per_rollout = cfg.trainer.global_batch_size * cfg.algorithm.steps_per_generation // cfg.rollout.n
        lines = [f"{cfg.algorithm.steps_per_generation} optimizer update(s) per rollout of {per_rollout} prompts; "
                 f"rollout steps = epochs {cfg.trainer.epochs} × ⌈prompts / {per_rollout}⌉ (the prompt file decides)"]
    else:
        lines = schedule.lines()
    return ("".join(f"# {line}\n" for line in ["schedule:", *lines])
            + f"# log-probs of π_θ, π_old, π_ref and CHORD's SFT terms: {cfg.rollout.logprobs_description()}\n")


def run(args: argparse.Namespace) -> int:
    from ..config import dump_yaml
    from ..config.check import load, validate
    from ..topology import weight_copy_path

    if args.verb == "validate":
        return validate(args.path, args.overrides, check_paths=not args.no_check_paths)
    cfg = load(args.path, args.overrides)
    if cfg is None:
        return 1
    sys.stdout.write(dump_yaml(cfg))
    sys.stdout.write(f"# in force: algorithm.correction.mode {cfg.correction_summary}\n")
    sys.stdout.write(schedule_comment(cfg))
    sys.stdout.write(f"# {weight_copy_path(cfg).line}\n")
    return 0
