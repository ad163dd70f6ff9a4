"""`megatron-rl sbatch RECIPE [key.path=value ...] [--nodes N ...] [-o FILE] [--submit]`."""

from __future__ import annotations

import argparse
import json
import sys

# Flag → recipe key: the flags are shorthands for overrides (and win over them).
FLAG_KEYS = (("nodes", "parallelism.nodes"), ("partition", "slurm.partition"), ("account", "slurm.account"),
             ("qos", "slurm.qos"), ("time", "slurm.time_limit"), ("job_name", "slurm.job_name"))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sbatch", help="render (and submit) the Slurm job script of a recipe")
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. slurm.partition=gpu trainer.lr=1e-6")
    p.add_argument("--nodes", type=int, help="trainer nodes (parallelism.nodes)")
    p.add_argument("--partition", help="slurm.partition")
    p.add_argument("--account", help="slurm.account")
    p.add_argument("--qos", help="slurm.qos")
    p.add_argument("--time", help="slurm.time_limit, e.g. 24:00:00")
    p.add_argument("--job-name", help="slurm.job_name")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="where the script goes (default <run dir>/slurm/job.sbatch; '-' = stdout); the resolved "
                        "recipe it trains goes beside it as <name>.recipe.yaml")
    p.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    p.add_argument("--no-check-paths", action="store_true",
                   help="do not require that files named in the recipe exist here (they are on the cluster)")
    p.set_defaults(func=run)


def flag_overrides(args: argparse.Namespace) -> list[str]:
    # JSON-quote strings: YAML would read --time 24:00:00 as the number 86400.
    return [f"{key}={json.dumps(getattr(args, flag))}" for flag, key in FLAG_KEYS
            if getattr(args, flag) is not None]


def run(args: argparse.Namespace) -> int:
    from ..config.check import load_checked
    from ..slurm import SbatchError, job_files, render_script, submit, write_job
    from ..slurm.render import job_recipe

    if args.nodes is not None and args.nodes < 1:
        print(f"error: --nodes {args.nodes}: parallelism.nodes must be >= 1", file=sys.stderr)
        return 1
    cfg = load_checked(args.recipe, list(args.overrides) + flag_overrides(args),
                       check_paths=not args.no_check_paths, warnings=False)
    if cfg is None:
        return 1
    to_stdout = args.output == "-"
    files = job_files(cfg, None if to_stdout else args.output)
    cfg = job_recipe(cfg, files)
    try:
        text = render_script(cfg, files, source=f"recipe {args.recipe} {' '.join(args.overrides)}".strip())
        write_job(cfg, files, None if to_stdout else text)
        if to_stdout:
            sys.stdout.write(text)
            return 0
        print(f"wrote {files.script}\n  trains {files.recipe}\n  run dir {files.run_dir}")
        if not args.submit:
            print(f"submit with: sbatch {files.script}")
            return 0
        job = submit(files.script)
    except SbatchError as exc:
        print(f"error: cannot make a job of {args.recipe}", file=sys.stderr)
        for line in exc.problems:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"Submitted batch job {job}\n  log {str(files.log).replace('%j', job)}")
    return 0
