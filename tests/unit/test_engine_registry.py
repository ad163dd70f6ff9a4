"""The servers' weight-transfer engines are found by name (`--weight-transfer-config`'s backend), as
vLLM's worker finds them: through vLLM's own factory, after the worker extension's import has
registered them (`rollout/engines/__init__.py`). A name that resolves to nothing, or to a class
that is not the vLLM engine it stands for, would only show on a GPU server's first sync; here it
shows on CPU. And every value the recipe key `rollout.weight_transfer` accepts has an engine."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.engines import ENGINES

REPO = Path(__file__).resolve().parents[2]

VLLM_BASES = {"shm": "vllm.distributed.weight_transfer.base.WeightTransferEngine",
              "nccl": "vllm.distributed.weight_transfer.nccl_engine.NCCLWeightTransferEngine",
              "ipc": "vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferEngine"}
"""The vLLM class each engine extends: `shm` is ours on vLLM's base, `nccl` / `ipc` are vLLM's own
engines with a count of what each worker loaded (their wire format must stay vLLM's)."""


def _vllm_class(dotted: str) -> type:
    import importlib

    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_every_engine_resolves_through_vllms_factory_to_its_vllm_base(backend: str) -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import megatron_rl.rollout.worker_ext  # noqa: F401  (what every vLLM worker imports: registers the engines)

    engine = ENGINES[backend]
    assert engine.name in WeightTransferEngineFactory._registry, engine
    cls = WeightTransferEngineFactory._registry[engine.name]()      # the factory's own lookup (create_engine)
    assert (cls.__module__, cls.__name__) == (engine.module, engine.cls)
    assert issubclass(cls, _vllm_class(VLLM_BASES[backend])), cls.__mro__
    assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__    # instantiable


def test_registering_twice_in_one_process_is_harmless() -> None:
    """vLLM may import the worker extension more than once in a process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from megatron_rl.rollout import engines

    engines.register()
    engines.register()
    assert {e.name for e in ENGINES.values()} <= set(WeightTransferEngineFactory._registry)


def test_every_recipe_transport_has_an_engine(tmp_path: Path) -> None:
    from megatron_rl.config import load_recipe
    from megatron_rl.rollout.server import RolloutServer

    accepted = set(typing.get_args(typing.get_type_hints(RolloutConfig)["weight_transfer"]))
    assert accepted == set(ENGINES)
    recipes = sorted(p for p in (REPO / "recipes").glob("*/*.yaml") if p.name != "base.yaml")
    assert len(recipes) >= 10
    for path in recipes:
        assert load_recipe(path).rollout.weight_transfer in ENGINES, path
    for backend in sorted(accepted):      # and the server is started with that engine's name
        command = RolloutServer(str(tmp_path), tmp_path, RolloutConfig(weight_transfer=backend), 128,
                                token="t").command()
        config = command[command.index("--weight-transfer-config") + 1]
        assert config == f'{{"backend": "{ENGINES[backend].name}"}}', (backend, config)
