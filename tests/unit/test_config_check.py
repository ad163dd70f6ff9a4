"""`config/check.py`: the one load → report → lint path of the commands, and what it prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config.check import load, load_checked, validate
from megatron_rl.config.rules import Finding

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "grpo.yaml")
BAD = ["trainer.lr=-1", "rollout.n=0"]
KL_WARNING = "algorithm.kl_in_reward=true"          # kl_beta 0: the kl-needs-reference warning
LINT_ERROR = "trainer.global_batch_size=33"         # batch-sizes: 8 generations do not divide 33


def test_load_prints_every_problem_under_a_heading_or_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert load(TINY, BAD) is None
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert out.out == "" and lines[0] == f"error: invalid recipe {TINY}" and len(lines) == 3
    assert all(line.startswith("  override #") for line in lines[1:])
    assert load(TINY, BAD, one_line=True) is None
    err = capsys.readouterr().err
    assert err.startswith(f"error: invalid recipe {TINY}: override #") and err.count("\n") == 1
    assert "; override #" in err
    assert load(TINY).name == "grpo"                                      # type: ignore[union-attr]


def test_load_checked_stops_on_lint_errors_and_can_leave_warnings_out(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_checked(TINY, [KL_WARNING], check_paths=False)
    out = capsys.readouterr()
    assert cfg is not None and "warning: [kl-needs-reference]" in out.err and out.out == ""
    assert load_checked(TINY, [KL_WARNING], check_paths=False, warnings=False) is not None
    assert capsys.readouterr().err == ""
    assert load_checked(TINY, [KL_WARNING, LINT_ERROR], check_paths=False, warnings=False) is None
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == f"error: {TINY} has lint errors (see above)"
    assert [line for line in lines[:-1] if "warning" in line] == [] and "[batch-sizes]" in lines[0]
    assert load_checked(TINY, BAD) is None
    assert capsys.readouterr().err.startswith(f"error: invalid recipe {TINY}\n")


def test_validate_prints_the_findings_and_one_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert validate(TINY, [KL_WARNING], check_paths=False) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[-1] == f"{TINY}: valid (0 errors, 1 warnings)" and out.err == ""
    assert validate(TINY, [LINT_ERROR], check_paths=False) == 1
    out = capsys.readouterr()
    assert "[batch-sizes]" in out.err and out.out == f"{TINY}: invalid (1 errors, 0 warnings)\n"
    seen: list[bool] = []

    def checks(cfg: object, check_paths: bool) -> list[Finding]:
        seen.append(check_paths)
        return [Finding("error", "fit", "parallelism", "does not fit")]

    assert validate(TINY, check_paths=False, checks=checks, verdicts=("preflight passed", "preflight failed")) == 1
    out = capsys.readouterr()
    assert seen == [False] and out.out == f"{TINY}: preflight failed (1 errors, 0 warnings)\n"
    assert out.err == "  error: [fit] parallelism: does not fit\n"
