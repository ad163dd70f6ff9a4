"""`megatron-rl rollout-server (RECIPE | --model DIR) [--run-dir DIR]`: start a rollout server and
keep it running (Ctrl-C stops it). The address goes to <run-dir>/rollout/server.json and the
secret token to <run-dir>/rollout/token.

`--weight-copy` (a rollout node of a disaggregated run, `weight_transfer: shm`): this process also
keeps the node's copy of the weights in its /dev/shm, received over the network from trainer rank 0
(`sync/network.py`), for the server's life; the trainer finds it beside server.json and sends every
version there instead of through the shared run dir."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollout-server", help="start the vLLM rollout server of a recipe or model")
    p.add_argument("recipe", nargs="?", help="recipe YAML (its model.init_checkpoint and rollout section)")
    p.add_argument("overrides", nargs="*", help="dotted overrides")
    p.add_argument("--model", help="HF model directory (instead of a recipe)")
    p.add_argument("--run-dir", default="runs/rollout-server", help="where address, token and log go")
    p.add_argument("--weight-copy", action="store_true",
                   help="receive the trainer's weights over the network into this node's /dev/shm")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..config.check import load_checked
    from ..config.schema import RecipeConfig
    from ..model_config import ModelConfigError, init_checkpoint
    from ..rollout.server import RolloutServer, ServerError
    from ..sync.network import RECEIVER_FILE, announce_receiver, receive_for

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
    run_dir = Path(args.run_dir)
    server = RolloutServer(init.hf_dir, run_dir, r, r.max_prompt_length + r.max_response_length,
                           extra_args=init.server_args)
    (run_dir / "rollout" / RECEIVER_FILE).unlink(missing_ok=True)          # an earlier attempt's
    if args.weight_copy:
        announce_receiver(run_dir)           # before server.json: rank 0 sees both at once
    try:
        server.start()
        print(f"rollout server at {server.base_url}; token in {server.rollout_dir / 'token'}; Ctrl-C stops it")
        if args.weight_copy:
            threading.Thread(target=receive_for, args=(run_dir.parent, run_dir.name, r.sync_bucket_mb << 20,
                                                       server.alive), name="weight-copy", daemon=True).start()
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
