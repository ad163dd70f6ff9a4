"""Slurm: render (and submit) the sbatch script of a recipe."""

from .render import JobFiles, SbatchError, job_files, render_script, sbatch_problems
from .submit import submit, write_job

__all__ = ["JobFiles", "SbatchError", "job_files", "render_script", "sbatch_problems", "submit", "write_job"]
