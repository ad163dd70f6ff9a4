"""Load → report → lint: the one path by which every command reads a recipe.

`load` prints the loader's problems (file:line, key, why) and returns None; `load_checked` adds the
lint (`rules.py`) for the commands that go on to run the recipe; `validate` prints every finding
and one verdict line for the commands that only check it (`recipe validate`, `train --dry-run`,
whose preflight is passed in: it needs the planner and a tokenizer, which `config/` does not
import).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from ..topology import weight_copy_path
from .errors import ConfigError
from .loader import load_recipe
from .rules import Finding, lint
from .schema import RecipeConfig

Checks = Callable[[RecipeConfig, bool], list[Finding]]
"""(recipe, check_paths) → findings: `rules.lint`, or the dry run's preflight."""


def load(path: str, overrides: Sequence[str] = (), *, one_line: bool = False) -> RecipeConfig | None:
    """The recipe, or None after printing every problem the loader found on stderr: under a heading,
    one per line, or (`one_line`: `plan`, whose bad input is always one line) joined by '; '."""
    try:
        return load_recipe(path, list(overrides))
    except ConfigError as exc:
        if one_line:
            print(f"error: invalid recipe {path}: " + "; ".join(str(p) for p in exc.problems), file=sys.stderr)
        else:
            print(f"error: invalid recipe {path}", file=sys.stderr)
            for problem in exc.problems:
                print(f"  {problem}", file=sys.stderr)
        return None


def load_checked(path: str, overrides: Sequence[str] = (), *, check_paths: bool = True,
                 warnings: bool = True) -> RecipeConfig | None:
    """Load + lint; print the findings on stderr (`warnings=False`: the errors only) and return None
    when the recipe cannot run."""
    cfg = load(path, overrides)
    if cfg is None:
        return None
    findings = [f for f in lint(cfg, check_paths) if warnings or f.level == "error"]
    for finding in findings:
        print(f"  {finding}", file=sys.stderr)
    if any(f.level == "error" for f in findings):
        print(f"error: {path} has lint errors (see above)", file=sys.stderr)
        return None
    return cfg


def validate(path: str, overrides: Sequence[str] = (), *, check_paths: bool = True, checks: Checks = lint,
             verdicts: tuple[str, str] = ("valid", "invalid")) -> int:
    """Load, run `checks`, print each finding (errors on stderr, warnings on stdout) and the verdict
    line `PATH: <passed|failed> (N errors, M warnings)`; the exit status (1 = an error)."""
    cfg = load(path, overrides)
    if cfg is None:
        return 1
    findings = checks(cfg, check_paths)
    errors = [f for f in findings if f.level == "error"]
    for finding in findings:
        print(f"  {finding}", file=sys.stderr if finding.level == "error" else sys.stdout)
    if not errors:          # which path the weights take is only news for a recipe that can run
        print(f"  {weight_copy_path(cfg).line}")
    passed, failed = verdicts
    print(f"{path}: {failed if errors else passed} ({len(errors)} errors, {len(findings) - len(errors)} warnings)")
    return 1 if errors else 0
