"""`megatron-rl rollout-server (RECIPE | --model DIR) [--run-dir DIR]`: start a rollout server and
keep it running (Ctrl-C stops it). The address goes to <run-dir>/rollout/server.json and the
secret token to <run-dir>/rollout/token."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollout-server", help="start the vLLM rollout server of a recipe or model")
    p.add_argument("recipe", nargs="?", help="recipe YAML (its model.init_checkpoint and rollout section)")
    p.add_argument("overrides", nargs="*", help="dotted overrides")
    p.add_argument("--model", help="HF model directory (instead of a recipe)")
    p.add_argument("--run-dir", default="runs/rollout-server", help="where address, token and log go")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..config.check import load_checked
    from ..config.schema import RecipeConfig
    from ..model_config import ModelConfigError, init_checkpoint
    from ..rollout.server import RolloutServer, ServerError

    if args.recipe:
        cfg = load_checked(args.recipe, args.overrides)
        if cfg is None:
            return 1
    else:
        cfg = RecipeConfig()
    model = args.model or cfg.model.init_checkpoint
    if not model:
        print("error: give a recipe with model.init_checkpoint, or --model DIR", file=sys.stderr)
        return 1
    r = cfg.rollout
    try:
        init = init_checkpoint(cfg.model, model)           # an HF directory or a dist-checkpoint
    except ModelConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    server = RolloutServer(init.hf_dir, Path(args.run_dir), r, r.max_prompt_length + r.max_response_length,
                           extra_args=init.server_args)
    try:
        server.start()
        print(f"rollout server at {server.base_url}; token in {server.rollout_dir / 'token'}; Ctrl-C stops it")
        while server.alive():
            time.sleep(2)
        print(f"error: rollout server exited; see {server.rollout_dir / 'server.log'}", file=sys.stderr)
        return 1
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
