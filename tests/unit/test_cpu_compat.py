"""The CPU patches still have something to patch: fail loudly after a megatron-core upgrade."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.rollout import unit_paths
from tests.mp.launch import REPO, cpu_env


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """In a subprocess: applying the patches changes torch.cuda for the whole process. CUDA is
    hidden, so on a GPU machine too the patches apply."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=cpu_env(**env))


def test_every_patched_symbol_exists_upstream() -> None:
    code = ("from megatron_rl.megatron import cpu_compat as c; assert c.apply(); "
            "missing = c.check_patched_symbols(); print(missing); assert not missing, missing; "
            "import torch; assert torch.zeros(1, device='cuda').device.type == 'cpu'; "
            "assert torch.zeros(1).type() == 'torch.cuda.FloatTensor'")
    proc = _python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("[]")


def test_megatron_imports_without_compiling_and_torch_compile_is_given_back() -> None:
    """megatron-core's `jit_fuser` methods stay plain functions on CPU (a compiled first call builds
    C++ kernels), dynamo and inductor are never imported, and torch.compile is torch's again."""
    code = ("import sys, inspect, importlib, torch; real = torch.compile\n"
            "from megatron_rl.megatron import cpu_compat as c; assert c.apply()\n"
            "import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.jit as jit\n"
            "for target, attr in c.UNCOMPILED_METHODS:\n"
            "    module, cls = target.rsplit('.', 1)\n"
            "    fn = inspect.getattr_static(getattr(importlib.import_module(module), cls), attr)\n"
            "    assert inspect.isfunction(fn) and not hasattr(fn, '_torchdynamo_orig_callable'), (target, attr, fn)\n"
            "assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser\n"
            "assert torch.compile is real\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))")
    proc = _python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


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


def test_required_cuda_refuses_instead_of_patching_for_the_cpu() -> None:
    """A GPU job (the sbatch script sets MEGATRON_RL_REQUIRE_CUDA) must not quietly train on the CPU."""
    code = ("import torch; from megatron_rl.megatron import cpu_compat as c\n"
            "try:\n    c.apply()\nexcept c.CudaRequiredError as exc:\n    print('REFUSED', exc)\n"
            "print('patched' if c._applied else 'untouched', torch.cuda.current_device.__module__)")
    proc = _python(code, MEGATRON_RL_REQUIRE_CUDA="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused, state = proc.stdout.strip().splitlines()
    assert refused.startswith("REFUSED 2 GPU(s) per node expected") and "CUDA sees 0" in refused
    assert "refusing to fall back to the CPU" in refused and "slurm.gpus_per_node=0" in refused
    assert state.startswith("untouched") and "megatron_rl" not in state     # torch.cuda left alone
    proc = _python(code, MEGATRON_RL_REQUIRE_CUDA="0")        # 0 = a CPU job: the patches apply
    assert proc.returncode == 0 and proc.stdout.strip().startswith("patched"), proc.stdout + proc.stderr[-2000:]
    proc = _python(code, MEGATRON_RL_REQUIRE_CUDA="eight")
    assert "expected a number of GPUs" in proc.stdout + proc.stderr


def test_train_refuses_a_gpu_recipe_without_cuda(tmp_path: Path) -> None:
    """`megatron-rl train` on a recipe that expects GPUs, where CUDA sees none: one clear error, exit 1,
    before any model, server or run dir is made."""
    recipe = REPO / "recipes" / "tiny" / "grpo.yaml"
    # unit_paths: the tiny recipe's files, which lint checks before the GPU check.
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", str(recipe), *unit_paths(recipe),
                           "slurm.gpus_per_node=1",
                           f"logging.output_dir={tmp_path}", "logging.run_name=r"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=cpu_env())
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "1 GPU(s) per node expected" in errors[0] and "CUDA sees 0" in errors[0], proc.stderr
    assert not (tmp_path / "r").exists()
