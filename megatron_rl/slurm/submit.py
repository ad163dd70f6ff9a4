"""Write a rendered job (script + resolved recipe) and hand it to sbatch."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..config.loader import dump_yaml
from ..config.schema import RecipeConfig
from .render import JobFiles, SbatchError


def write_job(cfg: RecipeConfig, files: JobFiles, script_text: str | None) -> None:
    """Write the resolved recipe (and the script unless None) and create the log directory.

    Slurm opens the `--output` file before the script runs, so its directory must exist now.
    """
    files.log.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(files.recipe, dump_yaml(cfg), 0o644)
    if script_text is not None:
        _atomic_write(files.script, script_text, 0o755)


def submit(script: Path, sbatch: str = "sbatch") -> str:
    """`sbatch --parsable SCRIPT`; returns the job id. Raises SbatchError with sbatch's message."""
    try:
        proc = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SbatchError([f"'{sbatch}' not found on PATH: submit from a Slurm login node, or drop --submit "
                           f"and run `sbatch {script}` there"]) from None
    if proc.returncode != 0:
        raise SbatchError([f"sbatch rejected {script} (exit {proc.returncode}): {proc.stderr.strip()}"])
    # --parsable prints 'jobid' or 'jobid;cluster'.
    return proc.stdout.strip().split(";")[0]


def _atomic_write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, mode)
    tmp.replace(path)
