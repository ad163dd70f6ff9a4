"""Recipe loading: inheritance, overrides, strict typing, error messages, resolved output."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import ConfigError, dump_yaml, load_recipe, schema, write_resolved
from megatron_rl.config.loader import parse_override

REPO = Path(__file__).resolve().parents[2]


def write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_recipe(path, overrides)
    return [str(p) for p in info.value.problems]


def test_defaults_chain_merges_sections_key_by_key(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "trainer:\n  lr: 0.5\n  epochs: 3\nrollout:\n  n: 4\n")
    write(tmp_path, "b.yaml", "defaults: a.yaml\ntrainer:\n  lr: 0.25\n")
    leaf = write(tmp_path, "c.yaml", "defaults: [b.yaml]\nrollout:\n  temperature: 0.9\n")
    cfg = load_recipe(leaf)
    assert cfg.trainer.lr == 0.25          # b overrides a
    assert cfg.trainer.epochs == 3         # kept from a
    assert cfg.rollout.n == 4              # sibling section from a survives c's rollout
    assert cfg.rollout.temperature == 0.9
    assert cfg.name == "c"


def test_several_defaults_apply_in_order(tmp_path: Path) -> None:
    write(tmp_path, "x.yaml", "rollout:\n  n: 2\n  top_k: 5\n")
    write(tmp_path, "y.yaml", "rollout:\n  n: 16\n")
    leaf = write(tmp_path, "leaf.yaml", "defaults: [x.yaml, y.yaml]\n")
    cfg = load_recipe(leaf)
    assert (cfg.rollout.n, cfg.rollout.top_k) == (16, 5)


def test_dotted_overrides_win_and_parse_as_yaml(tmp_path: Path) -> None:
    leaf = write(tmp_path, "r.yaml", "trainer:\n  lr: 0.1\n")
    cfg = load_recipe(leaf, ["trainer.lr=1e-6", "rollout.n=16", "algorithm.dual_clip_c=3",
                             "rewards.weights={mcq_answer: 1.5, japanese_only: 1.0}"])
    assert cfg.trainer.lr == pytest.approx(1e-6)
    assert cfg.rollout.n == 16
    assert cfg.algorithm.dual_clip_c == 3.0 and isinstance(cfg.algorithm.dual_clip_c, float)
    assert cfg.rewards.weights == {"mcq_answer": 1.5, "japanese_only": 1.0}


def test_malformed_override_is_an_error() -> None:
    for bad in ("trainer.lr", "=3", "trainer..lr=1"):
        with pytest.raises(ConfigError, match="key.path=value"):
            parse_override(bad)


def test_unknown_key_names_file_line_and_suggests(tmp_path: Path) -> None:
    leaf = write(tmp_path, "r.yaml", "algorithm:\n  name: grpo\n  clip_eps_hgh: 0.3\n")
    (msg,) = problems_of(leaf)
    assert f"{leaf}:3" in msg
    assert "algorithm.clip_eps_hgh" in msg
    assert "did you mean 'clip_eps_high'" in msg
    assert "allowed:" in msg and "clip_eps_low" in msg


def test_unknown_section_and_override_key(tmp_path: Path) -> None:
    leaf = write(tmp_path, "r.yaml", "trainr:\n  lr: 1\n")
    (msg,) = problems_of(leaf)
    assert "did you mean 'trainer'" in msg
    (msg,) = problems_of(write(tmp_path, "ok.yaml", "{}\n"), ["rollout.temprature=0.9"])
    assert "override #1 (rollout.temprature=0.9)" in msg and "did you mean 'temperature'" in msg


def test_wrong_type_names_expected_type(tmp_path: Path) -> None:
    leaf = write(tmp_path, "r.yaml", "rollout:\n  n: many\ntrainer:\n  seed: 1.5\n")
    msgs = problems_of(leaf)
    assert len(msgs) == 2                  # every problem is reported, not just the first
    assert f"{leaf}:2: rollout.n: got 'many' (str); expected int" in msgs[0]
    assert f"{leaf}:4: trainer.seed" in msgs[1] and "expected int" in msgs[1]


def test_bool_is_not_an_int_and_choices_are_listed(tmp_path: Path) -> None:
    leaf = write(tmp_path, "r.yaml", "rollout:\n  n: true\nalgorithm:\n  name: ppo\n")
    msgs = problems_of(leaf)
    assert "rollout.n" in msgs[0] and "expected int" in msgs[0]
    assert "algorithm.name" in msgs[1]
    assert "one of 'grpo', 'gspo', 'gspo_token', 'chord'" in msgs[1]


def test_value_out_of_range_names_bounds(tmp_path: Path) -> None:
    leaf = write(tmp_path, "r.yaml", "rollout:\n  top_p: 1.5\n")
    (msg,) = problems_of(leaf)
    assert f"{leaf}:2: rollout.top_p: value 1.5 is out of range; allowed: > 0.0 and <= 1.0" == msg


def test_missing_recipe_and_missing_base(tmp_path: Path) -> None:
    (msg,) = problems_of(tmp_path / "nope.yaml")
    assert "recipe file not found" in msg and "nope.yaml" in msg
    leaf = write(tmp_path, "r.yaml", "defaults: base.yaml\n")
    (msg,) = problems_of(leaf)
    assert f"{leaf}:1: defaults: base recipe not found" in msg


def test_inheritance_cycle_and_bad_yaml(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "defaults: b.yaml\n")
    write(tmp_path, "b.yaml", "defaults: a.yaml\n")
    (msg,) = problems_of(tmp_path / "a.yaml")
    assert "inheritance cycle" in msg
    (msg,) = problems_of(write(tmp_path, "bad.yaml", "trainer:\n  lr: [1\n"))
    assert "invalid YAML" in msg and "bad.yaml:" in msg


def test_relative_paths_follow_the_file_that_set_them(tmp_path: Path) -> None:
    sub = tmp_path / "sub"
    sub.mkdir()
    write(sub, "base.yaml", "data:\n  train_path: prompts.jsonl\n")
    leaf = write(tmp_path, "r.yaml", "defaults: sub/base.yaml\n")
    cfg = load_recipe(leaf, ["data.eval_path=e.jsonl"])
    assert cfg.data.train_path == str(sub / "prompts.jsonl")
    assert cfg.data.eval_path == str(Path.cwd() / "e.jsonl")


def test_resolved_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load_recipe(REPO / "recipes/tiny/gspo.yaml", ["trainer.lr=2e-3"])
    out = write_resolved(cfg, tmp_path / "run")
    assert out.name == "recipe.resolved.yaml"
    again = yaml.safe_load(out.read_text())
    assert again["trainer"]["lr"] == 2e-3 and again["algorithm"]["name"] == "gspo"
    assert again == yaml.safe_load(dump_yaml(cfg))
    reloaded = load_recipe(out)             # a resolved recipe is itself a valid recipe
    assert dataclasses.asdict(reloaded) == dataclasses.asdict(cfg)


def _dataclasses_of(module: object) -> list[type]:
    return [obj for _, obj in inspect.getmembers(module, inspect.isclass)
            if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__]


def test_every_field_has_a_docstring() -> None:
    tree = ast.parse(Path(schema.__file__).read_text(encoding="utf-8"))
    documented: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = set()
            for stmt, nxt in zip(node.body, node.body[1:]):
                if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) \
                        and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    names.add(stmt.target.id)
            documented[node.name] = names
    classes = _dataclasses_of(schema)
    assert len(classes) >= 11
    for cls in classes:
        missing = {f.name for f in dataclasses.fields(cls)} - documented[cls.__name__]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_derived_values_are_properties_of_the_schema() -> None:
    p = schema.ParallelismConfig(nodes=2, gpus_per_node=8, tensor_model_parallel_size=2,
                                 pipeline_model_parallel_size=2)
    assert (p.world_size, p.data_parallel_size, p.expert_tp) == (16, 4, 2)      # ETP defaults to TP
    assert dataclasses.replace(p, expert_tensor_parallel_size=1).expert_tp == 1
    # TP × PP beyond the world: at least one DP rank (the lint's parallel-sizes names the error).
    assert dataclasses.replace(p, nodes=1, gpus_per_node=2).data_parallel_size == 1
    cfg = schema.RecipeConfig(parallelism=p)
    assert cfg.gpus_per_node == 8                                  # slurm.gpus_per_node unset
    cpu = dataclasses.replace(cfg, slurm=schema.SlurmConfig(gpus_per_node=0))
    assert cpu.gpus_per_node == 0 and cpu.parallelism.gpus_per_node == 8
    a = schema.AlgorithmConfig(name="chord", chord=schema.ChordConfig(rl_objective="gspo"))
    assert (a.rl_objective, schema.AlgorithmConfig(name="gspo_token").rl_objective) == ("gspo", "gspo_token")
    # A reference model exists only for a KL term, whatever model.reference says.
    assert not schema.AlgorithmConfig().uses_reference and schema.AlgorithmConfig(kl_beta=0.1).uses_reference
    r = schema.RolloutConfig(temperature=0.7)
    assert r.logprobs_temperature == 0.7
    assert dataclasses.replace(r, logprobs_mode="raw").logprobs_temperature == 1.0


@pytest.mark.parametrize(("mode", "staleness", "in_force"), [
    ("auto", 0, "none"), ("auto", 1, "tis_token"), ("auto", 3, "tis_token"),
    ("none", 1, "none"), ("mask_token", 0, "mask_token"), ("tis_seq", 2, "tis_seq")])
def test_the_correction_in_force_follows_the_staleness_unless_written(mode: str, staleness: int,
                                                                      in_force: str) -> None:
    cfg = schema.RecipeConfig(rollout=schema.RolloutConfig(max_staleness=staleness),
                              algorithm=schema.AlgorithmConfig(correction=schema.CorrectionConfig(mode=mode)))
    assert schema.CorrectionConfig().mode == "auto"
    assert cfg.correction_mode == in_force
    # What the objectives get: the mode in force, everything else of `algorithm` as it was.
    run = cfg.algorithm_in_force
    assert run.correction.mode == in_force and cfg.algorithm.correction.mode == mode
    assert dataclasses.replace(run, correction=cfg.algorithm.correction) == cfg.algorithm


def test_config_sections_take_keywords_only() -> None:
    for cls in _dataclasses_of(schema):
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls.__name__
    with pytest.raises(TypeError):
        schema.ParallelismConfig(2)  # type: ignore[misc]
