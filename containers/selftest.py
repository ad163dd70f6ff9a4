"""Self-test of the megatron-rl image: Apptainer's %test, or
`docker run --gpus all IMAGE python /opt/megatron-rl/containers/selftest.py`.

1. every package the image installs from requirements/pins.txt imports, at the pinned version;
2. the stack fits together: torch is the version vLLM pins, Transformer Engine's torch extension
   loads against it, and megatron-core finds the fla kernels of Qwen3-Next's Gated DeltaNet. The
   base image's apex (NVIDIA's apex is not on PyPI) is only a warning: vLLM replaces the torch its
   extensions were built for, so they may not load, and nothing the project runs needs them
   (megatron-core takes Transformer Engine's fused kernels);
3. torch is a CUDA build with NCCL; with a GPU visible, a matmul on it and a one-rank NCCL
   all-reduce run (without one, e.g. on a build host, those two are skipped and say so);
4. with a GPU visible and the project's tests in the image, the `gpu`-marked tests (what
   `make test-gpu` runs).

Every stage runs whatever the ones before it found (a stage that raises is a failure of its own),
so one run of the image reports everything wrong with it, the GPU checks included.

Standard library + torch only at module level; Python 3.8+ (whatever the base image ships).
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

CONTAINER_SCOPES = ("gpu", "both", "nodeps", "gpu-late")
GPU_TESTS = ("tests/gpu",)
"""What `make test-gpu` runs (the Makefile's GPU_TESTS; tests/unit/test_containers.py checks they agree)."""
CACHE_ENV = "MEGATRON_RL_CACHE"
"""Where the tests build their demo assets (megatron_rl/commands/demo.py `cache_root`): the image's
tree is read-only."""
# Distribution name (as in pins.txt, without extras) → module to import. A pin without an entry
# fails tests/unit/test_containers.py, so a new pin cannot skip the self-test.
MODULES = {
    "megatron-core": "megatron.core",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "pyyaml": "yaml",
    "sentencepiece": "sentencepiece",
    "psutil": "psutil",
    "numpy": "numpy",
    "packaging": "packaging",
    "matplotlib": "matplotlib",
    "tensorboard": "tensorboard",
    "vllm": "vllm",
    "transformer-engine": "transformer_engine.pytorch",
    "flash-linear-attention": "fla",
    "pytest": "pytest",
    "torchao": "torchao",
}
# Provided by the base image or the project, not pinned (see the module docstring).
BASE_MODULES = ("torch", "megatron_rl", "megatron_rl.cli")
# What megatron-core's Gated DeltaNet imports from fla (megatron/core/ssm/gated_delta_net/common.py):
# without all three it refuses to build Qwen3-Next on a GPU.
FLA_SYMBOLS = (("fla.modules.convolution", "causal_conv1d"), ("fla.modules.l2norm", "l2norm"),
               ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"))
# apex's compiled extensions: they break first when torch changes under them.
APEX_EXTENSIONS = ("amp_C", "fused_layer_norm_cuda")


def container_pins(pins_file: Path) -> dict[str, str]:
    """{distribution: version} of the scopes the image installs, read from the one pin file."""
    pins = {}
    for line in pins_file.read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if not fields or line.startswith("#") or len(fields) < 3 or fields[2] not in CONTAINER_SCOPES:
            continue
        name, _, version = fields[0].partition("==")
        pins[name.split("[")[0]] = version
    return pins


def check_packages(pins: dict[str, str]) -> list[str]:
    problems = []
    for dist, version in sorted(pins.items()):
        module = MODULES.get(dist)
        if module is None:
            problems.append(f"{dist}: no module to import listed in containers/selftest.py MODULES")
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001  (any import failure is the finding)
            problems.append(f"{dist}: import {module} failed: {type(exc).__name__}: {exc}")
            continue
        installed = metadata.version(dist).split("+")[0]      # '2.9.0+cu13' is the pinned 2.9.0
        if installed != version:
            problems.append(f"{dist}: {installed} installed, requirements/pins.txt pins {version}")
    for module in BASE_MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"import {module} failed: {type(exc).__name__}: {exc}")
    return problems


def required_torch(requirements: list[str]) -> str | None:
    """The exact torch version in a distribution's requirements (vLLM pins one), else None."""
    for req in requirements:
        m = re.match(r"^torch\s*==\s*([^;\s]+)\s*(;.*)?$", req)
        if m and (m.group(2) is None or "x86_64" in m.group(2) or "aarch64" in m.group(2)):
            return m.group(1)
    return None


def check_stack() -> list[str]:
    """torch / TE / vLLM / fla / apex fit together (the versions alone do not say so)."""
    import torch

    problems = []
    wanted = required_torch(metadata.requires("vllm") or [])
    have = torch.__version__.split("+")[0]
    if wanted is not None and have != wanted.split("+")[0]:
        problems.append(f"torch {torch.__version__} installed, vllm {metadata.version('vllm')} pins torch=={wanted} "
                        "(containers/README.md, Build order)")
    try:
        import transformer_engine_torch  # noqa: F401  (the extension compiled against torch)
    except Exception as exc:  # noqa: BLE001
        problems.append(f"Transformer Engine's torch extension does not load against torch {torch.__version__}: "
                        f"{type(exc).__name__}: {exc}")
    for module, name in FLA_SYMBOLS:
        try:
            getattr(importlib.import_module(module), name)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"fla: {module}.{name} (megatron-core's Gated DeltaNet needs it): "
                            f"{type(exc).__name__}: {exc}")
    for warning in check_apex():
        print(f"WARN {warning}")
    return problems


def check_apex() -> list[str]:
    """Warnings, never failures: apex's extensions against the installed torch."""
    try:
        importlib.import_module("apex")
    except ImportError:
        print("apex: not in the base image (megatron-core uses Transformer Engine's fused kernels)")
        return []
    warnings = []
    for ext in APEX_EXTENSIONS:
        try:
            importlib.import_module(ext)
        except ImportError as exc:
            if "No module named" in str(exc):
                continue       # this extension was not built into the base's apex
            warnings.append(f"apex: extension {ext} does not load against the installed torch (built for the "
                            f"base's torch, which vLLM replaced): {exc}; unused here (megatron-core takes "
                            "Transformer Engine's kernels)")
    return warnings


def run_gpu_tests(home: Path) -> list[str]:
    """`pytest -m gpu tests/gpu` where the image carries the tests and a GPU is visible."""
    tests = home / "tests" / "gpu"
    if not tests.is_dir():
        print(f"GPU tests skipped: {tests} not in the image")
        return []
    # What `make test-gpu` runs.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *(str(home / t) for t in GPU_TESTS)],
                          cwd=home, env={**os.environ, CACHE_ENV: os.environ.get(CACHE_ENV, tempfile.mkdtemp())})
    return [] if proc.returncode == 0 else [f"GPU tests failed (pytest exit {proc.returncode}, output above)"]


def check_cuda() -> list[str]:
    import torch

    if torch.version.cuda is None:
        return [f"torch {torch.__version__} is not a CUDA build"]
    try:
        nccl = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001
        return [f"NCCL not loadable: {exc}"]
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, nccl))}")
    if not torch.cuda.is_available():
        print("no GPU visible: GPU matmul and NCCL all-reduce skipped (run `apptainer test --nv IMAGE` on a GPU node)")
        return []
    x = torch.randn(256, 256, device="cuda")
    if not torch.allclose((x @ torch.eye(256, device="cuda")), x):
        return ["a matmul on the GPU gave a wrong result"]
    return _nccl_all_reduce()


def _nccl_all_reduce() -> list[str]:
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        return [] if torch.equal(t, torch.ones(4, device="cuda")) else ["NCCL all-reduce gave a wrong result"]
    finally:
        dist.destroy_process_group()


def _stage(name: str, check: Callable[[], list[str]]) -> list[str]:
    """One stage's problems; a stage that raises is one problem, and the next stage still runs."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001  (reported, then the other stages run)
        return [f"{name}: raised {type(exc).__name__}: {exc}"]


def _gpu_tests_if_a_gpu(home: Path) -> list[str]:
    import torch

    if not torch.cuda.is_available():
        print("GPU tests skipped: no GPU visible")
        return []
    return run_gpu_tests(home)


def main() -> int:
    home = Path(os.environ.get("MEGATRON_RL_HOME", Path(__file__).resolve().parents[1]))
    problems = _stage("packages", lambda: check_packages(container_pins(home / "requirements" / "pins.txt")))
    problems += _stage("stack", check_stack)
    problems += _stage("cuda", check_cuda)
    problems += _stage("gpu tests", lambda: _gpu_tests_if_a_gpu(home))
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    print("image self-test: " + ("FAILED" if problems else "ok"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
