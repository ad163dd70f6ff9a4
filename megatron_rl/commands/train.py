"""`megatron-rl train RECIPE [key.path=value ...] [--resume]` and its preflight
`megatron-rl train --dry-run RECIPE [--no-check-paths] [--gpu-memory-gb M]`."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run RL training from a recipe (rollout server started automatically)")
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6 rollout.n=16")
    p.add_argument("--resume", action="store_true",
                   help="continue the run dir (logging.output_dir/logging.run_name) from its latest checkpoint")
    p.add_argument("--dry-run", action="store_true",
                   help="check the recipe without the model and exit: lint rules (batch and SFT splits over "
                        "DP, rollout TP×DP per node, memory options), data files and prompt lengths, the "
                        "planner's fit")
    p.add_argument("--no-check-paths", action="store_true",
                   help="with --dry-run: skip the checks that need the recipe's files (cluster paths)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0,
                   help="with --dry-run: memory of one GPU for the fit check (default 80)")
    p.set_defaults(func=run)


def dry_run(args: argparse.Namespace) -> int:
    from ..config.check import validate
    from ..preflight import preflight

    return validate(args.recipe, args.overrides, check_paths=not args.no_check_paths,
                    checks=lambda cfg, check_paths: preflight(cfg, check_paths, args.gpu_memory_gb),
                    verdicts=("preflight passed", "preflight failed"))


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        return dry_run(args)
    if args.no_check_paths:
        print("error: --no-check-paths only applies to --dry-run (training needs the files)", file=sys.stderr)
        return 1
    from ..config.check import load_checked

    cfg = load_checked(args.recipe, args.overrides)
    if cfg is None:
        return 1
    if cfg.logging.run_name:
        from ..train.rundir import refusal

        # Before the trainer is imported (seconds): another experiment's run dir is refused at once.
        problem = refusal(cfg, Path(cfg.logging.output_dir) / cfg.logging.run_name, args.resume)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 1
    from ..megatron import cpu_compat

    # Before anything is built: a GPU recipe must not quietly train on the CPU.
    problem = cpu_compat.cuda_problem(cfg.gpus_per_node)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    cpu_compat.apply()   # before the trainer imports megatron-core
    from ..train.loop import train

    try:
        run_dir = train(cfg, resume=args.resume)
    except _run_errors() as exc:
        if os.environ.get("MEGATRON_RL_TRACEBACK"):
            raise
        _forget_unstarted_run(cfg)
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    print(f"run dir: {run_dir}")
    return 0


def _run_errors() -> tuple[type[BaseException], ...]:
    """What a run meets from its inputs and environment (data, model, tokenizer, disk, server) —
    reported as one line (MEGATRON_RL_TRACEBACK=1 shows the traceback). Anything else is a bug
    and keeps its traceback."""
    import httpx

    from ..megatron.checkpoint import OptimizerLayoutMismatch
    from ..rollout.client import RolloutError
    from ..rollout.server import ServerError
    from ..rollout.supervisor import RestartCheckFailed
    from ..train.run import Stop

    return (Stop, ValueError, OSError, ServerError, RolloutError, RestartCheckFailed, OptimizerLayoutMismatch,
            httpx.HTTPError)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or exc.__class__.__name__
    return text if type(exc).__module__.startswith("megatron_rl") else f"{exc.__class__.__name__}: {text}"


def _forget_unstarted_run(cfg) -> None:  # noqa: ANN001
    """A run that failed before its first step leaves no run dir behind to block a re-run."""
    from ..train.rundir import never_started

    if not cfg.logging.run_name:
        return
    run = Path(cfg.logging.output_dir) / cfg.logging.run_name
    if run.is_dir() and never_started(run):
        shutil.rmtree(run, ignore_errors=True)
