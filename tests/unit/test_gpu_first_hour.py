"""tools/gpu_first_hour.sh on the CPU, with a stand-in Python: the script's own logic — stage order,
timeouts within the 9-minute budget, the offline install, everything under $OUT, the final JSON
line — and that every file and flag it hands to pip, pytest and the smoke exists, so the script
cannot fail by construction the first time a GPU is lent (it never ran before that either). The
stand-in compiles the `-c` snippets the box will run, runs the script's summary for real, and fakes
pip, pytest and the smoke's GPU work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_first_hour.sh"
STAGES = ["env", "install", "smoke", "gpu_tests", "tf32"]

STAND_IN = r'''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
def record(kind):
    with open(os.environ["STUB_LOG"], "a") as f:
        f.write(json.dumps({"kind": kind, "args": args, "cwd": os.getcwd(), "path": os.environ.get("PYTHONPATH", ""),
                            "tf32": os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"),
                            "keep": os.environ.get("MEGATRON_RL_GPU_TESTS_KEEP_TF32")}) + "\n")
if args and args[0] == "-":
    os.execv(REAL, [REAL, *args])          # the script's own summary: really run
if args and args[0] == "-c":
    compile(args[1], "<-c>", "exec")       # the GPU box runs it: here it must at least compile
    print("stand-in for python -c: megatron-core 0.19.2")
    sys.exit(0)
if args[:3] == ["-m", "pip", "install"]:
    record("pip")
    if "--no-index" not in args or "--no-deps" not in args:
        sys.exit("pip: would reach the network or resolve dependencies")
    Path(args[args.index("--target") + 1]).mkdir(parents=True, exist_ok=True)
    missing = [a for a in args if a.endswith(".whl") and not Path(a).is_file()]
    sys.exit(f"pip: no such wheel {missing}" if missing else 0)
if args[:2] == ["-m", "pytest"]:
    record("pytest")
    missing = [a for a in args if a.endswith(".py") and not Path(a).is_file()]
    if missing:
        print(f"ERROR: file or directory not found: {missing}")
        sys.exit(4)
    for a in args:
        if a.startswith("--junitxml="):
            Path(a.split("=", 1)[1]).write_text("<testsuite/>")
    print("3 passed, 2 skipped")
    sys.exit(int(os.environ.get("STUB_PYTEST_RC", "0")))
if args and args[0].endswith("gpu_smoke.py"):
    record("smoke")
    if not Path(args[0]).is_file():
        sys.exit(f"no such file {args[0]}")
    print(json.dumps({"ok": True, "models": {}}))
    sys.exit(0)
sys.exit(f"stand-in python: unexpected {args}")
'''


def run(tmp_path: Path, wheels: bool = True, **env: str) -> tuple[subprocess.CompletedProcess, Path, list[dict]]:
    bin_dir, out, wheel_dir = tmp_path / "bin", tmp_path / "out", tmp_path / ".whl"
    bin_dir.mkdir(exist_ok=True)
    wheel_dir.mkdir(exist_ok=True)
    if wheels:
        for name in ("megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl", "torchao-0.18.0-py3-none-any.whl"):
            (wheel_dir / name).write_bytes(b"stand-in")
    stub = bin_dir / "python3"
    stub.write_text(f"#!{sys.executable}\nREAL = {sys.executable!r}\n{STAND_IN}")
    stub.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    # A bare box's environment: none of the TF32 switches that tests/gpu/conftest.py sets when imported.
    bare = {k: v for k, v in os.environ.items() if "TF32" not in k}
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**bare, "PYTHON": str(stub), "OUT": str(out), "WHEELS": str(wheel_dir),
                               "STUB_LOG": str(log), "TMPDIR": str(tmp_path), **env})
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, out, calls


def test_every_stage_runs_offline_within_the_budget_and_ends_with_one_json_line(tmp_path: Path) -> None:
    proc, out, calls = run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["passed"] == STAGES and summary["failed"] == [] and summary["skipped"] == [], summary
    assert list(summary["stages"]) == STAGES
    assert sum(s["timeout_s"] for s in summary["stages"].values()) <= summary["budget_s"] <= 540
    assert all((out / s["log"]).is_file() for s in summary["stages"].values())
    assert json.loads((out / "smoke.json").read_text())["ok"] is True and (out / "gpu_tests.xml").is_file()
    assert "megatron-core" in (out / "install.log").read_text()          # the import check ran
    kinds = [c["kind"] for c in calls]
    assert kinds == ["pip", "smoke", "pytest", "pytest"], kinds
    pip, smoke, tests, tf32 = calls
    target = pip["args"][pip["args"].index("--target") + 1]
    assert target in smoke["path"].split(":") and target in tests["path"].split(":")   # the installed site
    assert str(REPO) in tests["path"].split(":") and tests["cwd"] == str(REPO)
    assert "tests/gpu/test_qwen3_next_gpu.py" in tests["args"] and tests["tf32"] is None
    assert tf32["tf32"] == "1" and tf32["keep"] == "1" and tf32["args"][-1] == "tests/gpu/test_qlora_gpu.py"
    assert not list(tmp_path.glob("gpu_first_hour.*"))                   # its scratch is gone


def test_without_wheels_install_fails_and_the_rest_is_skipped_with_the_reason(tmp_path: Path) -> None:
    proc, out, calls = run(tmp_path, wheels=False)
    assert proc.returncode == 1
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["passed"] == ["env"] and summary["failed"] == ["install"], summary
    assert summary["skipped"] == ["smoke", "gpu_tests", "tf32"]
    assert "install failed" in summary["stages"]["smoke"]["note"]
    assert "--download" in (out / "install.log").read_text() and calls == []


def test_a_failing_stage_fails_the_run_but_not_the_later_stages(tmp_path: Path) -> None:
    proc, _, _ = run(tmp_path, STUB_PYTEST_RC="1")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 1 and summary["failed"] == ["gpu_tests"], summary
    assert summary["passed"] == ["env", "install", "smoke", "tf32"]     # exit 1 under TF32: it ran
