"""How `make test` spreads the suite over two pytest-xdist workers (tests/conftest.py).

Most of the suite's time is set-up that a test file pays once (module-scoped servers, converted
checkpoints, the session's one-node Slurm), so the unit of work is a file, and every file that uses
the `slurm` fixture is one unit: a second worker would start a second Slurm cluster on the same
node. Units run longest first (the Slurm group, then e2e, integration, unit), so the short unit
files fill the end of both workers instead of one worker finishing a long e2e file alone.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SLURM_UNIT = "slurm jobs (one cluster per session)"
# Costliest first: a file of an earlier class starts before any file of a later one.
ORDER = ("slurm", "e2e", "integration", "gpu", "unit")


@cache
def uses_slurm(path: Path) -> bool:
    """Whether a test file asks for the session's one-node Slurm (a `slurm` argument anywhere)."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(a.arg == "slurm" for a in node.args.args + node.args.kwonlyargs):
                return True
    return False


def unit_of(nodeid: str, root: Path) -> str:
    """The work unit of a test id: its file, or the one Slurm unit."""
    file = nodeid.split("::", 1)[0]
    return SLURM_UNIT if uses_slurm(root / file) else file


def cost_class(path: Path, tier: str | None) -> int:
    """Position of a test file in `ORDER` (lower runs first)."""
    kind = "slurm" if uses_slurm(path) else (tier or "unit")
    return ORDER.index(kind) if kind in ORDER else len(ORDER)
