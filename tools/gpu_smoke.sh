#!/usr/bin/env bash
# One-GPU smoke check of the trainer's GPU path (tools/gpu_smoke.py); prints one JSON line and
# exits non-zero when a check fails. Runs on the CPU too (CI: tests/unit/test_gpu_smoke.py).
# `qwen3_moe_qlora` builds the QLoRA spec on CUDA (local linears holding the NF4 base; TE's norms
# and attention when TE is installed, its "spec" entry says which).
#
#   tools/gpu_smoke.sh [--models qwen3_moe,qwen3_next,qwen3_moe_qlora] [--dtype bf16|fp32]
#
# On a machine without megatron-core, put its wheel and those of what it imports (numpy, packaging),
# PyYAML, and for full coverage einops, fla-core, flash-linear-attention and torchao, in a directory
# and pass it as SMOKE_WHEELS=/path/to/wheels: they are unpacked into a temporary directory on
# PYTHONPATH (no pip, no network; pure-Python wheels, or ones built for this Python). PYTHON picks the interpreter (default: the repo's .venv, else python3).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then py="$repo/.venv/bin/python"; else py=python3; fi
fi
path="$repo"
if [[ -n "${SMOKE_WHEELS:-}" ]]; then
  site="$(mktemp -d)"
  trap 'rm -rf "$site"' EXIT
  "$py" - "$SMOKE_WHEELS" "$site" <<'PY'
import sys, zipfile, pathlib
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    zipfile.ZipFile(wheel).extractall(sys.argv[2])
PY
  path="$path:$site"
fi
export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# 8 minutes is the budget on a one-GPU machine; the script itself takes well under that.
timeout "${SMOKE_TIMEOUT_S:-480}" "$py" "$repo/tools/gpu_smoke.py" "$@"
