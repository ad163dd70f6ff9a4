"""HF ↔ Megatron dist-checkpoint conversion: the launcher side (no torch, no megatron imports).

`run_conversion` starts torchrun (`megatron_rl.launch`) with CPU gloo workers (`worker.py`, entered
through `python -m megatron_rl.convert`); each builds only its own shard of the model at the
requested layout (`job.ConvertLayout`) and either fills it from the HF safetensors (hf-to-mcore,
then one torch_dist checkpoint via `save_checkpoint`) or loads the dist-checkpoint and streams it
layer by layer into HF shards (mcore-to-hf).

Failures: the workers check names and shapes against the model before loading anything and
report every missing, unexpected or mis-shaped tensor in one error; outputs are built in hidden
temporary directories next to `--out` and renamed into place only when complete.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from ..ports import free_port
from .job import ConversionError, ConvertJob, check_job


def run_conversion(job: ConvertJob, force: bool = False) -> int:
    """Validate, run the workers, report. Returns the exit status (0 ok, 1 failed)."""
    try:
        check_job(job, force)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    world = job.layout.world_size()
    print(f"{job.direction}: {job.src} → {job.out} at {job.layout} ({world} CPU worker(s))", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="megatron-rl-convert-") as errors:
        job = replace(job, error_dir=errors)
        proc = subprocess.Popen(_worker_command(job, world), env=_worker_env(), stdout=_stderr_fd(),
                                stderr=subprocess.PIPE, text=True, errors="replace")
        try:
            _, log = proc.communicate()
        except BaseException:
            _stop(proc)
            raise
        if proc.returncode == 0 and Path(job.out).is_dir():
            return 0
        print(f"error: {_failure_message(Path(errors), log, proc.returncode)}", file=sys.stderr)
        return 1


def _worker_command(job: ConvertJob, world: int) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.launch", f"--nproc-per-node={world}", "--nnodes=1",
            "--master-addr=127.0.0.1", f"--master-port={free_port('127.0.0.1')}",
            "-m", "megatron_rl.convert", job.to_json()]


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # Conversion is I/O and memcpy: CPU workers, one thread each unless the user says otherwise.
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("OMP_NUM_THREADS", "1")
    # glibc raises its mmap threshold after large frees, after which freed layer-sized buffers stay
    # in the heap and count as RSS for the rest of the run; a fixed threshold returns them.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _stderr_fd() -> int | None:
    """Workers print progress on their stdout, which goes to our stderr; torchrun's own log and
    the workers' stderr are captured and shown only when something fails without an error file."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM lets torchrun stop its workers; SIGKILL would orphan them."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _failure_message(errors: Path, log: str, status: int) -> str:
    files = sorted(errors.glob("rank*.txt"), key=lambda p: int(p.stem[4:]))
    if files:
        return files[0].read_text().rstrip()
    tail = "\n".join(log.splitlines()[-60:])
    return f"conversion workers failed (exit {status}); last output:\n{tail}"
