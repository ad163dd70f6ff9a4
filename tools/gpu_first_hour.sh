#!/usr/bin/env bash
# The first GPU hour (../shared/notes/gpu-readiness-audit-3.md §5) as one script, for a bare CUDA box:
# torch (CUDA build), Python 3.12, numpy, packaging, PyYAML, einops, transformers, pytest — no vLLM,
# Transformer Engine or megatron-core, and no network. Everything it writes goes under $OUT; its
# last line on stdout is one JSON object naming every stage as passed, failed or skipped.
#
#   tools/gpu_first_hour.sh                 # on the GPU box (the device tool: carry [".whl"])
#   tools/gpu_first_hour.sh --download      # beforehand, where PyPI is reachable: fill .whl/
#
# The wheels come from the ignored folder $WHEELS (default .whl/ at the repository root):
# megatron-core (cp312), torchao, fla-core and flash-linear-attention, about 7.5 MB, installed with
# `pip install --no-index --no-deps --target` into a temporary site directory (never the system's).
#
# Stages, in order, each under its own timeout and all within BUDGET_S (default 540 s = 9 min;
# a stage gets what is left if that is less):
#   env        torch, CUDA, the GPU (nvidia-smi when present)                       → env.log
#   install    the wheels of $WHEELS, offline                                      → install.log
#   smoke      tools/gpu_smoke.sh: the trainer's GPU path on the local spec, Qwen3-Next's GDN on
#              fla, QLoRA's NF4 base on CUDA (one JSON line: smoke.json)             → smoke.log
#   gpu_tests  the GPU tests that need no vLLM / TE (they skip, naming what they need): the
#              235B recipes' offloaded optimizer, devices + NCCL + a step, QLoRA's fp32/bf16 bounds,
#              Qwen3-Next on fla against a float64 twin (TF32 off: tests/gpu/conftest.py)  → gpu_tests.log
#   tf32       the QLoRA test under the NGC base's TF32 override (audit 3 #2), to size its error;
#              passes when pytest ran to the end, and records whether the bounds held  → tf32.log
# A stage whose prerequisite failed is skipped, with the reason. Exit status: 0 when nothing failed.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${WHEELS:-$repo/.whl}"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-540}"
DOWNLOAD=(megatron-core==0.19.2 torchao==0.18.0 fla-core==0.6.0 flash-linear-attention==0.6.0)

if [[ "${1:-}" == "--download" ]]; then
    # The box runs Python 3.12 on x86_64 (the audit's §5); pins as in requirements/pins.txt.
    mkdir -p "$WHEELS"
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$WHEELS" "${DOWNLOAD[@]}"
fi

OUT="${OUT:?set OUT: the folder everything is written to}"
mkdir -p "$OUT"
scratch="${TMPDIR:-/tmp}/gpu_first_hour.$$"
site="$scratch/site"
mkdir -p "$site"
trap 'rm -rf "$scratch"' EXIT
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"
export MEGATRON_RL_CACHE="$scratch/cache"     # the tests' demo assets: off the (maybe read-only) tree
start=$SECONDS
results="$OUT/stages.tsv"
: > "$results"

# run_stage NAME TIMEOUT_S CMD...: the command under min(TIMEOUT_S, what is left of BUDGET_S), its
# output in $OUT/NAME.log; one line NAME<TAB>status<TAB>rc<TAB>seconds<TAB>timeout<TAB>note.
run_stage() {
    local name=$1 limit=$2 left t0 rc status note=""
    shift 2
    left=$((BUDGET_S - (SECONDS - start)))
    (( left < limit )) && limit=$left
    if (( limit < 5 )); then
        printf '%s\tskipped\t-\t0\t%s\t%s\n' "$name" "$limit" "the ${BUDGET_S}s budget is spent" >> "$results"
        return 1
    fi
    t0=$SECONDS
    # A new bash runs the stage (a function is no program `timeout` could exec); timeout signals its
    # whole process group, so torchrun's ranks go with it.
    timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    status=passed
    if (( rc == 124 || rc == 137 )); then status=failed; note="timed out after ${limit}s"
    elif (( rc != 0 )); then status=failed; note="exit $rc"; fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" "$note" >> "$results"
    [[ $status == passed ]]
}

skip_stage() {   # skip_stage NAME REASON
    printf '%s\tskipped\t-\t0\t0\t%s\n' "$1" "$2" >> "$results"
}

env_probe() {
    command -v nvidia-smi > /dev/null && nvidia-smi
    "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), "devices", torch.cuda.device_count());
print("device 0:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'
}

install_wheels() {
    shopt -s nullglob
    local wheels=("$WHEELS"/*.whl)
    if (( ${#wheels[@]} == 0 )); then
        echo "no wheels in $WHEELS: run tools/gpu_first_hour.sh --download where PyPI is reachable" >&2
        return 1
    fi
    "$PY" -m pip install --no-index --no-deps --disable-pip-version-check --target "$site" "${wheels[@]}" &&
        "$PY" -c 'import megatron.core, importlib.util as u
print("megatron-core", megatron.core.__version__, {m: u.find_spec(m) is not None for m in ("fla", "torchao", "einops")})'
}

gpu_tests() {   # $@: extra pytest arguments
    cd "$repo" && "$PY" -m pytest -p no:cacheprovider -m gpu -q -rs "$@" \
        tests/gpu/test_cpu_offload.py tests/gpu/test_devices_and_collectives.py tests/gpu/test_qlora_gpu.py \
        tests/gpu/test_qwen3_next_gpu.py tests/gpu/test_te_logprobs.py
}

tf32_probe() {
    # The NGC base's switch, and tests/gpu/conftest.py told to leave it on: the test may fail here.
    cd "$repo" && TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 MEGATRON_RL_GPU_TESTS_KEEP_TF32=1 \
        "$PY" -m pytest -p no:cacheprovider -m gpu -q -rs tests/gpu/test_qlora_gpu.py
    local rc=$?
    echo "qlora under the TF32 override: pytest exit $rc ($( ((rc == 0)) && echo "bounds held" || echo "bounds failed"))"
    (( rc == 0 || rc == 1 ))       # ran to the end, either way
}

export -f env_probe install_wheels gpu_tests tf32_probe
export PY WHEELS site repo
run_stage env 30 env_probe
if run_stage install 60 install_wheels; then
    run_stage smoke 200 env SMOKE_TIMEOUT_S=190 PYTHON="$PY" "$repo/tools/gpu_smoke.sh"
    tail -n 1 "$OUT/smoke.log" > "$OUT/smoke.json"
    run_stage gpu_tests 180 gpu_tests --junitxml="$OUT/gpu_tests.xml"
    run_stage tf32 60 tf32_probe
else
    for s in smoke gpu_tests tf32; do skip_stage "$s" "install failed: megatron-core is not importable"; done
fi

"$PY" - "$results" "$OUT" "$((SECONDS - start))" "$BUDGET_S" <<'PY'
import json, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
stages = {r[0]: {"status": r[1], "rc": None if r[2] == "-" else int(r[2]), "seconds": int(r[3]),
                 "timeout_s": int(r[4]), "note": r[5], "log": f"{r[0]}.log"} for r in rows}
out = {k: [n for n, s in stages.items() if s["status"] == k] for k in ("passed", "failed", "skipped")}
print(json.dumps({**out, "seconds": int(sys.argv[3]), "budget_s": int(sys.argv[4]), "out": sys.argv[2],
                  "stages": stages}))
PY
! grep -q $'\tfailed\t' "$results"
