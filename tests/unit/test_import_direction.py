"""Imports flow one way between `megatron/`, `weights/`, the model folders and the model registry
above them, and the CPU patches of megatron-core are an explicit call.

Allowed: a model folder (`megatron_rl/models/<name>/`) imports `megatron/`, `weights/map.py`,
`config`, `model_config`, `models/model_spec.py` and other folders; `megatron/` never imports
`weights/` or `models/`; `weights/map.py` (the map's building blocks) imports nothing of the
project. The registry (`megatron_rl.models`) sits above them all and reaches the folders only by
name, and neither `megatron/gpt.py` nor `weights/` imports it. Read from the source (every import
statement, also inside functions and under TYPE_CHECKING), so a new import in the wrong direction
fails here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.imports import imports_of, module_name
from tests.mp.launch import REPO

PKG = REPO / "megatron_rl"
REGISTRY = "megatron_rl.models"
SPEC = "megatron_rl.models.model_spec"


MODULES = {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_megatron_never_imports_weights_or_a_model_folder() -> None:
    bad = {(m, i) for m, imps in MODULES.items() if _under(m, "megatron_rl.megatron") for i in imps
           if _under(i, "megatron_rl.weights") or _under(i, REGISTRY)}
    assert not bad


def test_model_folders_import_only_downward() -> None:
    allowed = ("megatron_rl.megatron", "megatron_rl.weights.map", "megatron_rl.model_config",
               "megatron_rl.config", SPEC)
    folders = {m: imps for m, imps in MODULES.items() if _under(m, REGISTRY) and m not in (REGISTRY, SPEC)}
    assert {m.split(".")[2] for m in folders} == {"qwen3", "qwen3_next"}
    bad = {(m, i) for m, imps in folders.items() for i in imps
           if not any(_under(i, a) for a in allowed) and not (_under(i, REGISTRY) and i not in (REGISTRY, SPEC))}
    assert not bad


def test_the_registry_sits_above_megatron_and_weights_and_reaches_folders_by_name() -> None:
    weight_map = MODULES["megatron_rl.weights.map"]
    assert weight_map == set()
    for building_blocks in ("megatron_rl.weights.map", "megatron_rl.megatron.gpt", "megatron_rl.weights.loading"):
        assert not {i for i in MODULES[building_blocks] if _under(i, REGISTRY)}
    # the registry itself imports folders by name only
    assert {i for i in MODULES[REGISTRY] if _under(i, REGISTRY)} == {SPEC}


def test_each_folder_has_a_provider_a_weight_map_and_planner_shapes() -> None:
    from megatron_rl.models import MODELS, specs

    for spec in specs():
        assert (PKG / "models" / spec.name / "provider.py").is_file()
        assert (PKG / "models" / spec.name / "weights.py").is_file()
    assert {arch for spec in specs() for arch in spec.shapes} == set(MODELS.names())


def _cycles(edges: set[tuple[str, str]]) -> list[str]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    return sorted(a for a in graph if reaches(a, a, {a}))


def test_no_import_cycle_between_megatron_weights_and_models() -> None:
    scope = ("megatron_rl.megatron", "megatron_rl.weights", REGISTRY, "megatron_rl.model_config",
             "megatron_rl.planner", "megatron_rl.convert")

    def package(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:3]) if _under(m, REGISTRY) and len(parts) > 2 else ".".join(parts[:2])

    edges = {(package(m), package(i)) for m, imps in MODULES.items() for i in imps
             if package(m) != package(i) and any(_under(m, p) for p in scope) and any(_under(i, p) for p in scope)}
    cycles = _cycles(edges)
    assert not cycles, f"packages on an import cycle: {cycles}"


def test_no_module_cycle_in_the_registries_tasks_and_converter() -> None:
    """Module by module: the objectives' and rewards' tables, the tasks, data, the converter (its
    launcher and workers) and the model registry form no cycle."""
    scope = ("megatron_rl.registry", "megatron_rl.objectives", "megatron_rl.advantages", "megatron_rl.rewards",
             "megatron_rl.data", "megatron_rl.tasks", "megatron_rl.convert", REGISTRY)
    edges = {(m, i) for m, imps in MODULES.items() for i in imps
             if m != i and any(_under(m, p) for p in scope) and any(_under(i, p) for p in scope)}
    cycles = _cycles(edges)
    assert not cycles, f"modules on an import cycle: {cycles}"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU patches are a no-op with CUDA")
def test_cpu_patches_are_an_explicit_call() -> None:
    # Importing the GPT building blocks without the call fails with the fix in the message ...
    proc = _python("import megatron_rl.megatron.gpt")
    assert proc.returncode != 0 and "call megatron_rl.megatron.cpu_compat.apply()" in proc.stderr
    # ... the weight maps and the planner neither patch torch nor import megatron-core ...
    proc = _python(
        "import sys, torch\n"
        "from megatron_rl.models import weight_map\n"
        "from megatron_rl.planner.params import count_params\n"
        "from tests.helpers.models import TINY_QWEN3_NEXT\n"
        "weight_map(TINY_QWEN3_NEXT), count_params(TINY_QWEN3_NEXT)\n"
        "from megatron_rl.megatron import cpu_compat\n"
        "assert not cpu_compat._applied and torch.cuda.current_device is not None\n"
        "assert not [m for m in sys.modules if m.startswith('megatron.core')], 'megatron-core imported'\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # ... and after the explicit call a provider imports.
    proc = _python("from megatron_rl.megatron import cpu_compat; assert cpu_compat.apply()\n"
                   "import megatron_rl.megatron.gpt, megatron_rl.models.qwen3_next.provider")
    assert proc.returncode == 0, proc.stderr[-2000:]
