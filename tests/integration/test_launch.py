"""`megatron_rl.launch` (torchrun with a bound store) when a one-node run's rendezvous port is taken."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "import os; print('worker MASTER_PORT', os.environ['MASTER_PORT'], flush=True)"


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "megatron_rl.launch", "--nproc-per-node=1",
                           "--master-addr=127.0.0.1", *args, str(script)],
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_one_node_run_whose_port_was_taken_starts_on_another_and_a_named_endpoint_does_not(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        one = _launch(tmp_path, f"--master-port={taken}")
        assert one.returncode == 0, one.stderr[-3000:]
        assert f"rendezvous port {taken} was taken; starting again on " in one.stderr
        (line,) = [x for x in one.stdout.splitlines() if x.startswith("worker MASTER_PORT")]
        assert int(line.split()[-1]) not in (taken, 0)          # the worker was told the new port
        # A rendezvous endpoint the user named (as a multi-node run's, which other nodes dial) is
        # not ours to change: the run fails and says why.
        named = _launch(tmp_path, f"--rdzv-endpoint=127.0.0.1:{taken}")
        assert named.returncode != 0 and "Address already in use" in named.stderr
        assert "starting again" not in named.stderr
