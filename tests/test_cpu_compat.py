"""The CPU patches still have something to patch: fail loudly after a megatron-core upgrade."""

from __future__ import annotations

import subprocess
import sys

from tests.mp.launch import REPO


def _python(code: str) -> subprocess.CompletedProcess:
    """In a subprocess: applying the patches changes torch.cuda for the whole process."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_every_patched_symbol_exists_upstream() -> None:
    code = ("from megatron_rl.megatron import cpu_compat as c; assert c.apply(); "
            "missing = c.check_patched_symbols(); print(missing); assert not missing, missing; "
            "import torch; assert torch.zeros(1, device='cuda').device.type == 'cpu'; "
            "assert torch.zeros(1).type() == 'torch.cuda.FloatTensor'")
    proc = _python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("[]")


def test_check_reports_a_vanished_symbol() -> None:
    code = ("from megatron_rl.megatron import cpu_compat as c; c.apply(); "
            "c.PATCHED_SYMBOLS = c.PATCHED_SYMBOLS + (('megatron.core.tensor_parallel.random', 'gone_fn'),"
            "('megatron.core.optimizer.distrib_optimizer.DistributedOptimizer', 'gone_method')); "
            "print(c.check_patched_symbols())")
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()[-1]
    assert "random.gone_fn" in out and "DistributedOptimizer.gone_method" in out
    assert "paged_stash" not in out          # the real symbols are all still there
