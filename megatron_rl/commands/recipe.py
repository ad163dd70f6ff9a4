"""`megatron-rl recipe validate|show PATH [key.path=value ...]`."""

from __future__ import annotations

import argparse
import sys


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


def run(args: argparse.Namespace) -> int:
    from ..config import ConfigError, dump_yaml, load_recipe
    from ..lint import lint

    try:
        cfg = load_recipe(args.path, args.overrides)
    except ConfigError as exc:
        print(f"error: invalid recipe {args.path}", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    if args.verb == "show":
        sys.stdout.write(dump_yaml(cfg))
        return 0
    findings = lint(cfg, check_paths=not args.no_check_paths)
    errors = [f for f in findings if f.level == "error"]
    for finding in findings:
        print(f"  {finding}", file=sys.stderr if finding.level == "error" else sys.stdout)
    status = "invalid" if errors else "valid"
    warnings = len(findings) - len(errors)
    print(f"{args.path}: {status} ({len(errors)} errors, {warnings} warnings)")
    return 1 if errors else 0
