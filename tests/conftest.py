"""Shared pytest set-up: the tiers follow the folders, GPU tests skip (with the reason) without CUDA.

Tiers (`CONTRIBUTING.md`): `unit/` pure logic and single-process megatron-core; `integration/` one
real vLLM server or a torchrun group; `e2e/` the trainer CLI, Slurm and the fault bench; `gpu/`
needs CUDA. Each test gets its folder's marker, and `integration`/`e2e` tests also get `slow`, so
`-m "not slow"` still selects the unit tier.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_rl.console import KNOWN_WARNINGS, quiet_third_party
from tests.helpers.models import tiny, tiny_moe  # noqa: F401  (fixtures of the unit and integration tiers)
from tests.helpers.schedule import cost_class, unit_of
from tests.helpers.servers import (  # noqa: F401  (the shared rollout server)
    demo_server,
    demo_servers_dir,
    demo_weights_server,
)
from tests.helpers.slurm import slurm  # noqa: F401  (the session's one-node Slurm)

REPO_ROOT = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "e2e", "gpu")
SLOW_TIERS = ("integration", "e2e")

# Two cores: keep each test process from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_configure(config: pytest.Config) -> None:
    """Hide the known third-party warnings the CLI hides (megatron-core imported in-process); ours
    still show. pytest resets `warnings` filters around collection and each test, so they go in
    as `filterwarnings` lines."""
    quiet_third_party()
    for category, message, module in KNOWN_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{message}:{category.__name__}:{module}")


def tier_of(path: Path) -> str | None:
    """The tier folder a test file sits in (None for files outside the tiers)."""
    parts = path.resolve().relative_to(REPO_ROOT / "tests").parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = None if _cuda_available() else pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    # Costliest files first (tests/helpers/schedule.py); a stable sort keeps each file's tests
    # together and in their order, so module-scoped fixtures are still set up once.
    items.sort(key=lambda item: cost_class(Path(str(item.fspath)), tier_of(Path(str(item.fspath)))))
    for item in items:
        tier = tier_of(Path(str(item.fspath)))
        if tier is None:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in one of tests/{{{','.join(TIERS)}}}/")
        if tier == "unit" and "slow" in item.keywords:
            raise pytest.UsageError(f"{item.nodeid}: marked slow but in tests/unit/; move it to integration/ or e2e/")
        item.add_marker(getattr(pytest.mark, tier))
        if tier in SLOW_TIERS:
            item.add_marker(pytest.mark.slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under `pytest -n N` (`make test`): one work unit per file, the Slurm files as one unit, in
    the collection's (costliest-first) order. Optional: the GPU image runs pytest without xdist."""
    from xdist.scheduler import LoadScopeScheduling

    root = Path(str(config.rootpath))

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, root)

    config.option.loadscopereorder = False
    return FileUnits(config, log)
