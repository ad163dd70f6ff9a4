"""`megatron-rl` command line: one sub-command module per verb under `megatron_rl.commands`.

Each command module exposes `register(subparsers) -> None`, which adds its parser and sets
`func=<callable(args) -> int>` as the parser default. Modules are imported lazily by name so that
`megatron-rl recipe validate` never pays for importing torch or megatron-core.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .console import quiet_third_party

# Order is the order shown in `megatron-rl --help`.
COMMAND_MODULES: tuple[str, ...] = (
    "demo",
    "train",
    "rollout_server",
    "recipe",
    "data",
    "eval",
    "plan",
    "convert",
    "sbatch",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl",
        description="Megatron-LM-native RL post-training (GRPO, GSPO, CHORD).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"megatron_rl.commands.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    quiet_third_party()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides after an option (`train RECIPE --resume k=v`): argparse fills a positional list
    # only once, so the later ones come back unrecognized.
    if extra and isinstance(getattr(args, "overrides", None), list) and not any(x.startswith("-") for x in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
