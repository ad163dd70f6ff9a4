"""The suite's own machinery for two workers: demo assets built once when asked for at once, and
the work units and order of `make test` (tests/helpers/schedule.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.schedule import ORDER, SLURM_UNIT, cost_class, unit_of, uses_slurm
from tests.mp.launch import REPO

BUILD = """
import sys, yaml
from pathlib import Path
from megatron_rl.demo.prepare import prepare_demo_assets

fields = yaml.safe_load(Path("recipes/tiny/base.yaml").read_text())["model"]["tiny"]
paths = prepare_demo_assets(Path(sys.argv[1]), fields, warmup_steps=0, n_train=64, n_eval=16)
print("model", (paths["model"] / "model.safetensors").stat().st_size, flush=True)
"""


def test_two_processes_asking_at_once_build_the_assets_once(tmp_path: Path) -> None:
    """Two test workers start on an empty cache together: one builds while the other waits for
    it, and both get a whole model (without the lock the second deleted the first's folder)."""
    cache = tmp_path / "unit"
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(cache)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    builds = sum(out.count("[demo] building task data") for out in outs)
    assert builds == 1, outs
    sizes = {line.split()[1] for out in outs for line in out.splitlines() if line.startswith("model ")}
    assert len(sizes) == 1 and int(sizes.pop()) > 0
    assert (cache / "model" / "model.safetensors").is_file()
    assert (cache / "tokenizer").is_dir() and (cache / "train.jsonl").is_file()


def test_files_that_use_slurm_are_one_unit_and_run_first(tmp_path: Path) -> None:
    e2e = tmp_path / "tests" / "e2e"
    e2e.mkdir(parents=True)
    (e2e / "test_job.py").write_text("def test_a(slurm, tmp_path):\n    pass\n")
    (e2e / "test_other_job.py").write_text("def helper():\n    pass\n\ndef test_b(tmp_path, *, slurm):\n    pass\n")
    (e2e / "test_cli.py").write_text("SLURM = 'slurm'\n\ndef test_c(tmp_path):\n    pass\n")
    assert uses_slurm(e2e / "test_job.py") and uses_slurm(e2e / "test_other_job.py")
    assert not uses_slurm(e2e / "test_cli.py")              # the word alone does not make it a Slurm test
    assert unit_of("tests/e2e/test_job.py::test_a", tmp_path) == SLURM_UNIT
    assert unit_of("tests/e2e/test_other_job.py::test_b", tmp_path) == SLURM_UNIT
    assert unit_of("tests/e2e/test_cli.py::test_c[x::y]", tmp_path) == "tests/e2e/test_cli.py"
    assert cost_class(e2e / "test_job.py", "e2e") == ORDER.index("slurm")
    ranks = [cost_class(e2e / "test_cli.py", "e2e"), cost_class(tmp_path / "x.py", "integration"),
             cost_class(tmp_path / "y.py", "unit")]
    assert ranks == sorted(ranks) and len(set(ranks)) == 3


def test_the_real_slurm_files_are_found() -> None:
    tests = REPO / "tests"
    found = {p.relative_to(tests).as_posix() for p in tests.rglob("test_*.py") if uses_slurm(p)}
    assert {"e2e/test_sbatch.py", "e2e/test_walkthrough.py"} <= found
    assert all(name.startswith("e2e/") for name in found), found
