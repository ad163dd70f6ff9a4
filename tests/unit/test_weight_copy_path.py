"""Which path a recipe's weight syncs take (`topology.weight_copy_path`), over every production
recipe, and what `recipe validate` / `recipe show` say of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.topology import NODE_COPY_RECEIVERS, recipe_shm_senders, weight_copy_path

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = sorted(p for p in (REPO / "recipes").glob("qwen3_*/*.yaml") if p.name != "base.yaml")
IDS = [f"{p.parent.name}/{p.stem}" for p in PRODUCTION]


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_every_production_recipe_gets_one_stated_path(recipe: Path) -> None:
    cfg = load_recipe(recipe, [])
    r = cfg.rollout
    got = {receivers: weight_copy_path(cfg, receivers) for receivers in (False, True)}
    if r.weight_transfer != "shm":
        assert {c.kind for c in got.values()} == {"none"}
    elif r.placement == "disaggregated":
        # The network into each rollout node's /dev/shm where they run receivers, else the shared run dir.
        assert got[True].kind == "network" and f"{r.nodes} rollout nodes' /dev/shm" in got[True].line
        assert got[False].kind == "shared_run_dir" and "fallback" in got[False].line
        assert all(s.shared for s in recipe_shm_senders(cfg))       # what the trainer does without receivers
    else:
        kind = "nodes_shm" if len(recipe_shm_senders(cfg)) > 1 else "node_shm"
        assert {c.kind for c in got.values()} == {kind}          # the rollout nodes' receivers do not matter
    assert weight_copy_path(cfg) == got[NODE_COPY_RECEIVERS]


@pytest.mark.parametrize("verb", ["validate", "show"])
def test_recipe_validate_and_show_say_which_path(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(REPO / "recipes/qwen3_235b_a22b/grpo.yaml")
    for overrides, said in (([], weight_copy_path(load_recipe(recipe, [])).line),
                            (["rollout.weight_transfer=nccl"], "nccl from trainer rank 0's GPU"),
                            (["rollout.placement=colocated", "rollout.nodes=0"], "each of the 8 nodes' first rank")):
        assert main(["recipe", verb, recipe, *overrides, "--no-check-paths"]) == 0
        assert said in capsys.readouterr().out, overrides
