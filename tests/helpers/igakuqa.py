"""Where the tests find IgakuQA: a small synthetic fixture (always, committed under
tests/fixtures/igakuqa) and the real benchmark (only when present).

The real benchmark is a clone of github.com/jungokasai/IgakuQA (or a copy of its `data/` and
`baseline_results/`). Its path comes from `IGAKUQA_DIR`; without it, `../shared/data/igakuqa`
beside the repository is used when it exists. Tests marked `needs_real_igakuqa` are skipped, with
that reason, when neither is there. An `IGAKUQA_DIR` that is set but wrong is an error, not a
skip, so a CI job that passes the path (`.ci/run`) cannot silently lose these tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "igakuqa"
FIXTURE_BASELINES = FIXTURE / "baseline_results"
FIXTURE_SYSTEMS = ("alpha", "beta", "gamma")
DEFAULT_REAL = REPO_ROOT.parent / "shared" / "data" / "igakuqa"


def _real_dir() -> Path | None:
    env = os.environ.get("IGAKUQA_DIR")
    if env:
        path = Path(env)
        if not (path / "data").is_dir() or not (path / "baseline_results").is_dir():
            raise RuntimeError(f"IGAKUQA_DIR={env} is not an IgakuQA checkout "
                               f"(needs data/ and baseline_results/)")
        return path
    return DEFAULT_REAL if (DEFAULT_REAL / "data").is_dir() else None


REAL: Path | None = _real_dir()
# A placeholder keeps module-level path expressions valid; every test using it is skipped.
REAL_DIR: Path = REAL if REAL is not None else DEFAULT_REAL
REAL_BASELINES: Path = REAL_DIR / "baseline_results"
REAL_SYSTEMS = ("gpt4", "chatgpt", "gpt3", "student-majority", "translate_chatgpt-en")
needs_real_igakuqa = pytest.mark.skipif(
    REAL is None, reason=f"real IgakuQA data not found: set IGAKUQA_DIR to a clone of "
                         f"github.com/jungokasai/IgakuQA (default {DEFAULT_REAL} is absent)")
