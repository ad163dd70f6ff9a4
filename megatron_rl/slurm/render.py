"""Render the sbatch script of a recipe from the template `slurm/job.sbatch.in`.

The template holds the job's logic (preflight, rollout servers, torchrun, signal → requeue); this
module computes the values and inserts them. Every recipe value reaches the script quoted:
`shlex.quote` for shell lines, and the same quoting on `#SBATCH` lines, which sbatch parses itself
(it understands quotes). A newline would end an `#SBATCH` comment and turn the rest of the value
into a command, so values on those lines may hold no control characters.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..config.schema import RecipeConfig
from ..topology import weight_copy_path

TEMPLATE_ENV = "MEGATRON_RL_SBATCH_TEMPLATE"
"""Environment variable naming a site's own template (same placeholders) instead of the default."""

RUNTIMES = ("apptainer", "singularity", "none")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_MEM = re.compile(r"[0-9]+[KMGT]?")


class SbatchError(ValueError):
    """The recipe cannot become a job script; `problems` names each recipe key at fault."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class JobFiles:
    """Where a job's files go: all absolute, so the script works from any directory."""

    run_dir: Path
    """`logging.output_dir/logging.run_name`: the trainer's run dir (metrics, checkpoints)."""
    script: Path
    """The sbatch script."""
    recipe: Path
    """The resolved recipe the job trains (beside the script)."""
    log: Path
    """Slurm's output file pattern (`%j` = job id)."""
    workdir: Path
    """The job's working directory (`#SBATCH --chdir`): where `megatron-rl sbatch` ran."""


class _Template(string.Template):
    # `@@{NAME}`: bash uses `$` everywhere, `@` only as `$@` and `[@]`, never doubled.
    delimiter = "@@"
    idpattern = r"[A-Z_]+"


def job_files(cfg: RecipeConfig, script: str | Path | None = None, cwd: str | Path | None = None) -> JobFiles:
    """Paths of the job: the run dir is fixed now (a timestamped name when logging.run_name is
    unset) so that every requeued attempt of the job continues the same run."""
    base = Path(cwd) if cwd is not None else Path.cwd()
    out = Path(cfg.logging.output_dir).expanduser()
    out = out if out.is_absolute() else base / out
    name = cfg.logging.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(os.path.normpath(out / name))
    if script is None:
        script_path = run_dir / "slurm" / "job.sbatch"
    else:
        script_path = Path(script).expanduser()
        script_path = Path(os.path.normpath(script_path if script_path.is_absolute() else base / script_path))
    recipe = script_path.with_name(script_path.stem + ".recipe.yaml")
    return JobFiles(run_dir, script_path, recipe, run_dir / "slurm" / "%j.out", base)


def job_recipe(cfg: RecipeConfig, files: JobFiles) -> RecipeConfig:
    """The recipe as the job trains it: run dir pinned (absolute output_dir, explicit run_name)."""
    logging = dataclasses.replace(cfg.logging, output_dir=str(files.run_dir.parent), run_name=files.run_dir.name)
    return dataclasses.replace(cfg, logging=logging)


def parse_time_limit(text: str) -> int | None:
    """Seconds of a Slurm time limit ('MM', 'MM:SS', 'HH:MM:SS', 'D-HH[:MM[:SS]]'); None = unlimited."""
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE"):
        return None
    days = 0
    if "-" in t:
        head, _, t = t.partition("-")
        if not head.isdigit():
            raise ValueError(text)
        days = int(head)
    parts = t.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        raise ValueError(text)
    nums = [int(p) for p in parts]
    if days or "-" in text:      # D-HH, D-HH:MM, D-HH:MM:SS
        h, m, s = (nums + [0, 0])[:3]
    else:                        # MM, MM:SS, HH:MM:SS
        h, m, s = [0, *nums] if len(nums) == 2 else ([0, nums[0], 0] if len(nums) == 1 else nums)
    return ((days * 24 + h) * 60 + m) * 60 + s


def total_nodes(cfg: RecipeConfig) -> int:
    r = cfg.rollout
    return cfg.parallelism.nodes + (r.nodes if r.placement == "disaggregated" else 0)


def job_python(cfg: RecipeConfig) -> str:
    """The interpreter the job runs megatron-rl with (see ContainerConfig.python)."""
    if cfg.container.python:
        return cfg.container.python
    if cfg.container.runtime == "none":
        return sys.executable or "python3"
    return "python"


def sbatch_problems(cfg: RecipeConfig) -> list[str]:
    """What keeps the recipe from becoming a job script, each naming its key and what is allowed."""
    s, c = cfg.slurm, cfg.container
    problems: list[str] = []
    if c.runtime != "none" and not c.image:
        problems.append(f"container.image: not set, but container.runtime is {c.runtime!r}; give the .sif "
                        f"path, or run on the host with container.runtime: none (allowed: {', '.join(RUNTIMES)})")
    for key, value in (("slurm.job_name", s.job_name), ("slurm.partition", s.partition),
                       ("slurm.account", s.account), ("slurm.qos", s.qos), ("slurm.time_limit", s.time_limit),
                       ("logging.output_dir", cfg.logging.output_dir), ("logging.run_name", cfg.logging.run_name)):
        if value is not None and _CONTROL.search(value):
            problems.append(f"{key}: {value!r} holds a control character (newline, tab, ...); not allowed "
                            "on #SBATCH lines")
    for i, opt in enumerate(s.extra_sbatch):
        if not opt.startswith("-") or _CONTROL.search(opt):
            problems.append(f"slurm.extra_sbatch[{i}]: {opt!r} must be one sbatch option starting with '-' "
                            "(e.g. '--exclusive'), without control characters")
    for name in s.env:
        if not _ENV_NAME.fullmatch(name):
            problems.append(f"slurm.env: {name!r} is not a valid environment variable name "
                            "(allowed: letters, digits and '_', not starting with a digit)")
    if s.mem is not None and not _MEM.fullmatch(str(s.mem)):
        problems.append(f"slurm.mem: {s.mem!r} is not a Slurm memory size (allowed: '0' = all of the node's "
                        "memory, a number of MB, or a number with K, M, G or T, e.g. '900G'; null = no request)")
    if s.cpus_per_task is None and not s.exclusive:
        problems.append("slurm.cpus_per_task: null (every CPU of the node) needs slurm.exclusive: true; "
                        "on shared nodes give a number")
    problems.extend(_time_problems(s.time_limit, s.signal_before_s))
    return problems


def _time_problems(time_limit: str, signal_before_s: int) -> list[str]:
    try:
        limit = parse_time_limit(time_limit)
    except ValueError:
        return [f"slurm.time_limit: {time_limit!r} is not a Slurm time (allowed: 'MM', 'MM:SS', 'HH:MM:SS', "
                "'D-HH', 'D-HH:MM', 'D-HH:MM:SS', 'UNLIMITED'); quote it in YAML, where an unquoted "
                "24:00:00 is the number 86400"]
    if limit is not None and signal_before_s >= limit:
        return [f"slurm.signal_before_s: {signal_before_s} s is not shorter than slurm.time_limit "
                f"{time_limit!r} ({limit} s): the trainer would be told to stop as soon as it starts"]
    return []


def render_script(cfg: RecipeConfig, files: JobFiles, source: str = "", template: str | None = None) -> str:
    """The sbatch script for `cfg` (already pinned by `job_recipe`). Raises SbatchError."""
    problems = sbatch_problems(cfg)
    if problems:
        raise SbatchError(problems)
    text = template if template is not None else load_template()
    return _Template(text).substitute(
        SBATCH="\n".join(f"#SBATCH {line}" for line in sbatch_lines(cfg, files)),
        SOURCE=_comment(source or f"recipe {cfg.name}"),
        SETTINGS="\n".join(settings_lines(cfg, files)),
        ENVIRONMENT="\n".join(f"export {k}={shlex.quote(v)}" for k, v in cfg.slurm.env.items())
        or "# (none)",
    )


def load_template() -> str:
    """The site template named by $MEGATRON_RL_SBATCH_TEMPLATE, else slurm/job.sbatch.in."""
    override = os.environ.get(TEMPLATE_ENV)
    path = Path(override) if override else Path(__file__).resolve().parents[2] / "slurm" / "job.sbatch.in"
    if not path.is_file():
        where = f"${TEMPLATE_ENV}" if override else "the source tree (an install without the repository?)"
        raise SbatchError([f"sbatch template {path} not found (from {where}); set {TEMPLATE_ENV} to a copy of "
                           "slurm/job.sbatch.in"])
    return path.read_text(encoding="utf-8")


def sbatch_lines(cfg: RecipeConfig, files: JobFiles) -> list[str]:
    """The `#SBATCH` options (without the prefix), values quoted."""
    s = cfg.slurm
    q = shlex.quote
    lines = [f"--job-name={q(s.job_name or cfg.name)}", f"--nodes={total_nodes(cfg)}", "--ntasks-per-node=1"]
    # Whole nodes by default: 8 ranks, their NCCL threads and a busy-polling vLLM need every CPU,
    # and the HF load, the colocated server and the /dev/shm weight copies need the node's memory.
    if s.exclusive:
        lines.append("--exclusive")
    if s.cpus_per_task is not None:
        lines.append(f"--cpus-per-task={s.cpus_per_task}")
    if s.mem is not None:
        lines.append(f"--mem={s.mem}")
    if cfg.gpus_per_node:
        lines.append(f"--gpus-per-node={cfg.gpus_per_node}")
    lines.append(f"--time={q(s.time_limit)}")
    lines += [f"--{opt}={q(value)}" for opt, value in (("partition", s.partition), ("account", s.account),
                                                       ("qos", s.qos)) if value]
    # Append: a requeued attempt adds to the same log instead of truncating it.
    lines += [f"--output={q(str(files.log))}", "--open-mode=append", f"--chdir={q(str(files.workdir))}"]
    lines.append("--requeue" if s.requeue else "--no-requeue")
    if s.signal_before_s > 0:
        # B: to the batch shell only; it forwards the signal to the trainer and then requeues.
        lines.append(f"--signal=B:USR1@{s.signal_before_s}")
    return lines + list(s.extra_sbatch)


def container_words(cfg: RecipeConfig) -> list[str]:
    """`apptainer exec --nv --bind ... IMAGE` (empty when the runtime is 'none')."""
    c = cfg.container
    if c.runtime == "none":
        return []
    words = [c.runtime, "exec"]
    if cfg.gpus_per_node:
        words.append("--nv")
    for bind in c.binds:
        words += ["--bind", bind]
    return words + [str(c.image)]


def settings_lines(cfg: RecipeConfig, files: JobFiles) -> list[str]:
    """`NAME=value  # recipe key` assignments read by the template's logic."""
    q = shlex.quote
    r, s, p = cfg.rollout, cfg.slurm, cfg.parallelism
    values: list[tuple[str, str, str]] = [
        ("SCRIPT", q(str(files.script)), "this script (resubmitted when slurm.requeue is false)"),
        ("RECIPE", q(str(files.recipe)), "the resolved recipe the job trains"),
        ("RUN_DIR", q(str(files.run_dir)), "logging.output_dir / logging.run_name"),
        ("PY", q(job_python(cfg)), "container.python"),
        ("RUNTIME", q(cfg.container.runtime), "container.runtime"),
        ("IMAGE", q(str(cfg.container.image or "")), "container.image"),
        ("CONTAINER", "(" + " ".join(q(w) for w in container_words(cfg)) + ")", "container.*; () = on the host"),
        ("TRAIN_NODES", str(p.nodes), "parallelism.nodes"),
        ("ROLLOUT_NODES", str(r.nodes if r.placement == "disaggregated" else 0),
         f"rollout.nodes (placement: {r.placement})"),
        ("WEIGHT_COPY", "(--weight-copy)" if weight_copy_path(cfg).kind == "network" else "()",
         "each rollout node keeps its copy of the weights in its /dev/shm (topology.weight_copy_path)"),
        ("PROCS_PER_NODE", str(p.gpus_per_node), "parallelism.gpus_per_node"),
        ("GPUS_EXPECTED", str(cfg.gpus_per_node), "slurm.gpus_per_node (0 = CPU job)"),
        ("CPUS_PER_TASK", str(s.cpus_per_task or 0), "slurm.cpus_per_task (0 = every CPU of the node)"),
        ("SERVER_CPUS", str(colocated_server_cpus(cfg)), "CPUs the trainer ranks leave to a colocated vLLM server"),
        ("NUMA_BINDING", q(s.numa_binding if cfg.gpus_per_node else "none"),
         "slurm.numa_binding (GPU jobs only)"),
        ("NODE_MEM", q(str(s.mem) if s.mem is not None else "site default"), "slurm.mem (0 = all of the node's)"),
        ("KEEP_OMP_THREADS", "1" if "OMP_NUM_THREADS" in s.env else "0", "slurm.env sets OMP_NUM_THREADS"),
        ("MASTER_PORT", str(s.master_port), "slurm.master_port"),
        ("ROLLOUT_PORT", str(r.port), "rollout.port (0 = any free port)"),
        ("STARTUP_TIMEOUT_S", str(math.ceil(r.startup_timeout_s)), "rollout.startup_timeout_s"),
        ("REQUEUE", "1" if s.requeue else "0", "slurm.requeue"),
    ]
    return [f"{name}={value}  # {note}" for name, value, note in values]


def colocated_server_cpus(cfg: RecipeConfig) -> int:
    """CPUs a colocated vLLM server busies on its node: the API server, one engine core per DP
    rank and one worker per GPU (TP × DP); 0 when the servers have nodes of their own."""
    r = cfg.rollout
    if r.placement != "colocated":
        return 0
    return 1 + r.data_parallel_size + r.tensor_parallel_size * r.data_parallel_size


def _comment(text: str) -> str:
    """One comment line's worth of `text`: control characters would end the comment."""
    return _CONTROL.sub("?", text)
