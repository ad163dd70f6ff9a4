"""Imports flow one way between `megatron/`, `weights/` and the model folders, and the CPU patches
of megatron-core are an explicit call.

Allowed: a model folder (`megatron_rl/models/<name>/`) imports `megatron/`, `weights/adapters.py`,
`model_config` and the recipe schema (`config/schema.py`, the bottom layer: `ParallelismConfig`);
`megatron/` never imports `weights/` or a model folder; `weights/adapters.py` (the map's building
blocks) imports nothing of the project but `model_config`. The two registries
(`megatron/providers.py`, `weights/adapters.py`) reach the folders only through
`megatron_rl.models.load_model`, by name. Read from the source (every import statement, also
inside functions), so a new import in the wrong direction fails here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mp.launch import REPO

PKG = REPO / "megatron_rl"
REGISTRY = "megatron_rl.models"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every megatron_rl module `path` imports (relative imports resolved; `from x import y` counts
    as x.y when that is a module, else x)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                is_module = (REPO / Path(*full.split("."))).with_suffix(".py").is_file() or \
                    (REPO / Path(*full.split(".")) / "__init__.py").is_file()
                out.add(full if is_module else base)
    return {m for m in out if m == "megatron_rl" or m.startswith("megatron_rl.")}


MODULES = {_module_name(p): _imports(p) for p in PKG.rglob("*.py")}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_megatron_never_imports_weights_or_a_model_folder() -> None:
    bad = {(m, i) for m, imps in MODULES.items() if _under(m, "megatron_rl.megatron") for i in imps
           if _under(i, "megatron_rl.weights") or (_under(i, REGISTRY) and i != REGISTRY)}
    assert not bad


def test_model_folders_import_only_downward() -> None:
    allowed = ("megatron_rl.megatron", "megatron_rl.weights.adapters", "megatron_rl.model_config",
               "megatron_rl.config.schema", REGISTRY)
    folders = {m: imps for m, imps in MODULES.items() if _under(m, REGISTRY)}
    assert {m.split(".")[2] for m in folders if m != REGISTRY} == {"qwen3", "qwen3_next"}
    bad = {(m, i) for m, imps in folders.items() for i in imps if not any(_under(i, a) for a in allowed)}
    assert not bad


def test_registries_reach_folders_only_through_the_registry() -> None:
    adapters = MODULES["megatron_rl.weights.adapters"]
    assert adapters <= {"megatron_rl.model_config", REGISTRY}
    for registry in ("megatron_rl.weights.adapters", "megatron_rl.megatron.providers"):
        assert REGISTRY in MODULES[registry]
    assert MODULES[REGISTRY] == set()      # the registry itself imports folders by name only


def test_each_folder_has_a_provider_a_weight_map_and_planner_shapes() -> None:
    from megatron_rl.models import MODELS, planner_shapes

    for folder in set(MODELS.values()):
        assert (PKG / "models" / folder / "provider.py").is_file()
        assert (PKG / "models" / folder / "weights.py").is_file()
    assert set(planner_shapes()) == set(MODELS)


def test_no_import_cycle_between_megatron_weights_and_models() -> None:
    scope = ("megatron_rl.megatron", "megatron_rl.weights", REGISTRY, "megatron_rl.model_config",
             "megatron_rl.planner")

    def package(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:3]) if _under(m, REGISTRY) and len(parts) > 2 else ".".join(parts[:2])

    # The registry edges (by name, at call time) are the documented exception.
    edges = {(package(m), package(i)) for m, imps in MODULES.items() for i in imps
             if package(m) != package(i) and any(_under(m, p) for p in scope) and any(_under(i, p) for p in scope)
             and not (i == REGISTRY and m in (
                 "megatron_rl.weights.adapters", "megatron_rl.megatron.providers"))}
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    cycles = sorted(a for a in graph if reaches(a, a, {a}))
    assert not cycles, f"packages on an import cycle: {cycles}"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU patches are a no-op with CUDA")
def test_cpu_patches_are_an_explicit_call() -> None:
    # Importing a provider without the call fails with the fix in the message ...
    proc = _python("import megatron_rl.megatron.providers")
    assert proc.returncode != 0 and "call megatron_rl.megatron.cpu_compat.apply()" in proc.stderr
    # ... the weight maps and the planner neither patch torch nor import megatron-core ...
    proc = _python(
        "import sys, torch\n"
        "from megatron_rl.weights.adapters import adapter_for\n"
        "from megatron_rl.planner.params import ARCHITECTURES\n"
        "from tests.helpers.models import TINY_QWEN3_NEXT\n"
        "adapter_for(TINY_QWEN3_NEXT)\n"
        "from megatron_rl.megatron import cpu_compat\n"
        "assert not cpu_compat._applied and torch.cuda.current_device is not None\n"
        "assert not [m for m in sys.modules if m.startswith('megatron.core')], 'megatron-core imported'\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # ... and after the explicit call a provider builds.
    proc = _python("from megatron_rl.megatron import cpu_compat; assert cpu_compat.apply()\n"
                   "from megatron_rl.megatron.providers import build_model_recipe")
    assert proc.returncode == 0, proc.stderr[-2000:]
