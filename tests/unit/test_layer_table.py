"""Imports only go down: every module of `megatron_rl/` sits in one layer of `LAYERS` (kept here as
data), imports only its own layer or lower ones, and no import cycle exists anywhere in the package.

Imports are read from the source with `ast`: module-level, inside functions (lazy) and under
`TYPE_CHECKING` alike, relative ones resolved, `from pkg import name` counted as the module
`pkg.name` when that is a module. There is no list of allowed exceptions: a new upward import or
cycle fails here, and the fix is to move the code, not to add an edge.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.imports import cycles, graph_of, is_module
from tests.mp.launch import REPO

PKG = REPO / "megatron_rl"

# Lowest first. A module belongs to the layer of its longest matching prefix (a folder or a file).
# Within a layer any direction is allowed; the cycle test below still applies there.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("megatron_rl", "megatron_rl.types", "megatron_rl.registry", "megatron_rl.console", "megatron_rl.ports",
              "megatron_rl.model_config", "megatron_rl.config")),
    ("pure", ("megatron_rl.objectives", "megatron_rl.advantages", "megatron_rl.logprobs", "megatron_rl.fused_head",
              "megatron_rl.rewards",
              "megatron_rl.data", "megatron_rl.nf4", "megatron_rl.schedule", "megatron_rl.topology",
              "megatron_rl.send_plan")),
    ("tasks", ("megatron_rl.tasks",)),
    # The cross-field rules read tasks and the topology, so they sit above them, not with the schema.
    ("checks", ("megatron_rl.config.rules", "megatron_rl.config.check")),
    ("engines", ("megatron_rl.megatron", "megatron_rl.weights", "megatron_rl.rollout")),
    ("models", ("megatron_rl.models",)),
    ("programs", ("megatron_rl.convert", "megatron_rl.planner", "megatron_rl.sync", "megatron_rl.demo",
                  "megatron_rl.slurm", "megatron_rl.preflight", "megatron_rl.launch")),
    ("train", ("megatron_rl.train",)),
    ("cli", ("megatron_rl.commands", "megatron_rl.cli")),
)


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None               # (prefix length, layer index)
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), i)
    return None if best is None else best[1]


GRAPH = graph_of(PKG)


def test_every_module_sits_in_one_layer() -> None:
    unplaced = sorted(m for m in GRAPH if layer_of(m) is None)
    assert not unplaced, f"add these modules to LAYERS: {unplaced}"
    prefixes = [p for _, ps in LAYERS for p in ps]
    assert len(prefixes) == len(set(prefixes)), "a prefix is listed in two layers"
    assert all(is_module(p) for p in prefixes), [p for p in prefixes if not is_module(p)]


def test_no_upward_import() -> None:
    upward = sorted(f"{m} ({LAYERS[layer_of(m) or 0][0]}) -> {i} ({LAYERS[layer_of(i) or 0][0]})"
                    for m, imps in GRAPH.items() for i in imps
                    if (layer_of(i) or 0) > (layer_of(m) or 0))
    assert not upward, "\n".join(upward)


def test_no_import_cycle() -> None:
    assert cycles(GRAPH) == []


def test_the_reader_sees_relative_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..top import T\n")
    (pkg / "top.py").write_text("import os\n\ndef f():\n    from .sub.leaf import g\n    from pkg.sub import leaf\n")
    graph = graph_of(pkg, tmp_path)
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.leaf"}, "pkg.sub.leaf": {"pkg.top"},
                     "pkg.top": {"pkg.sub.leaf"}}
    assert cycles(graph) == [["pkg.sub.leaf", "pkg.top"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}) == [["a", "b", "c"]]


def test_the_fleet_holds_the_servers_and_the_publisher_their_weights() -> None:
    """`train/fleet.py` imports nothing from `sync/`: the weights on the servers have one owner,
    `train/publisher.py` (aesthetics review 3 §4)."""
    assert GRAPH["megatron_rl.train.publisher"] & {m for m in GRAPH if m.startswith("megatron_rl.sync")}
    from_sync = sorted(i for i in GRAPH["megatron_rl.train.fleet"]
                       if i == "megatron_rl.sync" or i.startswith("megatron_rl.sync."))
    assert not from_sync, f"train/fleet.py imports {from_sync}: the weights are train/publisher.py's"
