"""`megatron-rl plan RECIPE [key.path=value ...] [--nodes N] [--gpus-per-node G] [--gpu-memory-gb M]
[--modes] [--json]`: per-GPU memory of the recipe's layout, the verdict, and layouts that fit.

`--modes` adds full / LoRA / QLoRA side by side and, for each, the fewest nodes with a layout that
fits (`planner/modes.py`).

Exit status: 0 the recipe's layout fits, 2 it does not (the output suggests layouts that do),
1 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_DOES_NOT_FIT = 2


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-GPU memory of a recipe's layout; layouts that fit",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="recipe YAML file")
    p.add_argument("overrides", nargs="*",
                   help="dotted overrides, e.g. parallelism.pipeline_model_parallel_size=2")
    p.add_argument("--nodes", type=int, help="trainer nodes (overrides parallelism.nodes)")
    p.add_argument("--gpus-per-node", type=int,
                   help="GPUs per node (overrides parallelism.gpus_per_node)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0,
                   help="memory of one GPU in GB (default 80)")
    p.add_argument("--suggestions", type=int, default=5,
                   help="how many fitting layouts to list (default 5)")
    p.add_argument("--modes", action="store_true",
                   help="also compare full / LoRA / QLoRA training and the fewest nodes of each")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=run)


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = [] if args.nodes is None else [f"parallelism.nodes={args.nodes}"]
    if args.gpus_per_node is not None:
        extra.append(f"parallelism.gpus_per_node={args.gpus_per_node}")
    return list(args.overrides) + extra


def run(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_recipe
    from ..model_config import ModelConfigError, resolve_hf_config
    from ..planner import PlannerError
    from ..planner.memory import Hardware
    from ..planner.modes import compare, modes_json, render_modes
    from ..planner.plan import plan
    from ..planner.report import render, to_json

    try:
        if args.gpu_memory_gb <= 0 or args.suggestions < 0:
            raise PlannerError("--gpu-memory-gb must be > 0 and --suggestions >= 0")
        cfg = load_recipe(args.path, _overrides(args))
        hf = resolve_hf_config(cfg.model)
        if hf is None:
            raise PlannerError(f"{args.path}: the recipe names no model (model.hf_config or model.tiny)")
        hw = Hardware(cfg.parallelism.gpus_per_node, args.gpu_memory_gb)
        result = plan(cfg, hf, hw, args.suggestions)
        modes = compare(cfg, hf, hw) if args.modes else None
    except ConfigError as exc:
        print(f"error: invalid recipe {args.path}: " + "; ".join(str(p) for p in exc.problems),
              file=sys.stderr)
        return 1
    except (ModelConfigError, PlannerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        data = to_json(result) | ({"modes": modes_json(modes)} if modes else {})
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        sys.stdout.write(render(result) + ("\n" + render_modes(modes, hw) if modes else ""))
    return 0 if result.estimate.fits else EXIT_DOES_NOT_FIT
