"""`megatron-rl plan RECIPE [key.path=value ...] [--nodes N] [--gpus-per-node G] [--gpu TYPE]
[--gpu-memory-gb M] [--host-memory-gb H] [--prompt-tokens P] [--response-tokens R] [--rank memory|time]
[--modes] [--json]`: per-GPU memory of the recipe's layout, the host memory of every node role, a
verdict for each, the step's seconds per phase and tokens/s/GPU, and layouts that fit.

The time model's constants are those of `--gpu` (H100, H200, A100, B200: `planner/gpus.py`);
`--gpu-memory-gb` and `--host-memory-gb` default to that type's card and DGX node. Token counts
default to the caps (`max_prompt_length`, `max_response_length`): an upper bound of the step;
give the data's means with --prompt-tokens / --response-tokens. `--rank time` lists the layouts
that fit fastest first (each one timed); the default ranks by the memory proxy.

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
    p.add_argument("--gpu", default="H100", help="GPU type of the time model: H100, H200, A100, B200 (default H100)")
    p.add_argument("--gpu-memory-gb", type=float, help="memory of one GPU in GB (default: the --gpu type's, 80)")
    p.add_argument("--host-memory-gb", type=float,
                   help="RAM of one node in GB (default: the --gpu type's DGX node, 2048 for H100)")
    p.add_argument("--prompt-tokens", type=float, help="mean prompt tokens (default max_prompt_length)")
    p.add_argument("--response-tokens", type=float, help="mean response tokens (default max_response_length)")
    p.add_argument("--rank", choices=("memory", "time"), default="memory",
                   help="order of the fitting layouts: the memory proxy (default) or predicted step time")
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
    from ..config.check import load
    from ..model_config import ModelConfigError, resolve_hf_config
    from ..planner import PlannerError
    from ..planner.gpus import gpu
    from ..planner.memory import Hardware
    from ..planner.modes import compare, modes_json, render_modes
    from ..planner.plan import plan
    from ..planner.report import render, to_json
    from ..planner.timing import Workload

    try:
        spec = gpu(args.gpu)
        memory = spec.memory_gb if args.gpu_memory_gb is None else args.gpu_memory_gb
        host = spec.host_memory_gb if args.host_memory_gb is None else args.host_memory_gb
        if memory <= 0 or host <= 0 or args.suggestions < 0:
            raise PlannerError("--gpu-memory-gb and --host-memory-gb must be > 0 and --suggestions >= 0")
        if any(v is not None and v <= 0 for v in (args.prompt_tokens, args.response_tokens)):
            raise PlannerError("--prompt-tokens and --response-tokens must be > 0")
        cfg = load(args.path, _overrides(args), one_line=True)
        if cfg is None:
            return 1
        hf = resolve_hf_config(cfg.model)
        if hf is None:
            raise PlannerError(f"{args.path}: the recipe names no model (model.hf_config or model.tiny)")
        hw = Hardware(cfg.parallelism.gpus_per_node, memory, spec.name, host)
        workload = Workload.of(cfg, args.prompt_tokens, args.response_tokens)
        result = plan(cfg, hf, hw, args.suggestions, args.rank, workload)
        modes = compare(cfg, hf, hw) if args.modes else None
    except (ModelConfigError, PlannerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        data = to_json(result) | ({"modes": modes_json(modes)} if modes else {})
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        sys.stdout.write(render(result) + ("\n" + render_modes(modes, hw) if modes else ""))
    return 0 if result.estimate.fits else EXIT_DOES_NOT_FIT
