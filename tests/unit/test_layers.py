"""The import rules of ARCHITECTURE.md, checked on the source (module-level and in-function
imports alike): who may import megatron-core, vLLM and torch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
MEGATRON_CORE_HOMES = ("megatron", "weights", "models")
TORCH_FREE = ("config", "data", "rewards", "tasks", "console.py")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _modules() -> list[tuple[str, Path]]:
    return [(p.relative_to(PACKAGE).parts[0], p) for p in sorted(PACKAGE.rglob("*.py"))]


def test_only_the_engine_packages_import_megatron_core() -> None:
    offenders = [str(p.relative_to(PACKAGE)) for top, p in _modules()
                 if top not in MEGATRON_CORE_HOMES and any(n.split(".")[:2] == ["megatron", "core"]
                                                           for n in _imports(p))]
    assert offenders == []


def test_pure_layers_import_neither_torch_nor_megatron_rl_engines() -> None:
    offenders = []
    for top, path in _modules():
        if top not in TORCH_FREE:
            continue
        for name in _imports(path):
            root = name.split(".")[0]
            engine = name.startswith("megatron_rl.") and name.split(".")[1] in (
                "megatron", "weights", "rollout", "sync", "train", "commands")
            if root in ("torch", "megatron", "vllm") or engine:
                offenders.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert offenders == []


def test_the_trainer_names_no_task() -> None:
    """The loop reaches tasks only through `megatron_rl.tasks`, never a task's reward module."""
    offenders = [f"{p.relative_to(PACKAGE)}: {n}" for top, p in _modules() if top == "train"
                 for n in _imports(p) if n.startswith(("megatron_rl.rewards", "megatron_rl.tasks."))]
    relative = [str(p.relative_to(PACKAGE)) for top, p in _modules() if top == "train"
                and any(isinstance(node, ast.ImportFrom) and node.level and (node.module or "").startswith("rewards")
                        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))))]
    assert offenders == [] and relative == []
    sources = "".join(p.read_text(encoding="utf-8") for top, p in _modules() if top == "train")
    assert "[ans]" not in sources and "mcq_answer" not in sources
