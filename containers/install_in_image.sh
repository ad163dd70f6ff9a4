#!/usr/bin/env bash
# Runs inside the image build (Apptainer %post, Docker RUN): the pinned GPU stack, then this
# project. The requirement files and the mode were written by containers/build.sh from
# requirements/pins.txt (scopes gpu + both, gpu-late, nodeps), so no version is written here.
#   install_in_image.sh SRC_DIR WHEEL_DIR
#
# Order and constraints (why, in containers/README.md "Build order"):
#   1. gpu + both: vLLM and friends. vLLM pins an exact torch, which may replace the base's; the
#      base's PIP_CONSTRAINT (NVIDIA images pin their own torch there) is set aside for the pinned
#      steps — as /dev/null, not "": pip ignores an empty value, so a constraint from a pip.conf
#      would stay (pip/_internal/cli/parser.py, `_get_ordered_configuration_items`) —, and the
#      torch before and after is printed. From here torch is held where step 1 left
#      it (-c torch==that version).
#   2. gpu-late without build isolation: Transformer Engine's torch extension compiles against
#      that torch (not a second one in an isolated build env); fla's kernels run on its triton.
#   3. megatron-core --no-deps; 4. this project (editable).
set -euo pipefail
SRC=${1:?usage: install_in_image.sh SRC_DIR WHEEL_DIR}
WHEELS=${2:?usage: install_in_image.sh SRC_DIR WHEEL_DIR}
REQ="$SRC/requirements/container"

for f in gpu-requirements.txt gpu-late-requirements.txt nodeps-requirements.txt mode; do
    [[ -f "$REQ/$f" ]] || { echo "error: $REQ/$f missing; build with containers/build.sh" >&2; exit 1; }
done
# What the base must provide, checked before anything is installed (audit 3 #16): TE's torch sdist,
# built without isolation in step 2, imports wheel.bdist_wheel from the base's site-packages.
python -c 'import wheel.bdist_wheel' || { echo "error: the base image has no 'wheel' package, which step 2" \
    "(Transformer Engine's torch extension, --no-build-isolation) needs; pick an NGC PyTorch base that has it" >&2; exit 1; }
echo "[image] pip configuration of the base (a constraint here is overridden with PIP_CONSTRAINT=/dev/null):"
python -m pip config list || true
pip=(python -m pip install --no-cache-dir --disable-pip-version-check)
if [[ "$(cat "$REQ/mode")" == offline ]]; then
    # Air-gapped: only the wheels build.sh copied in (from `build.sh --offline WHEELDIR`).
    pip+=(--no-index --find-links "$WHEELS")
fi
# The installed distribution's version, as pip matches it: PyPI's CUDA wheels say 2.13.0 there while
# torch.__version__ says 2.13.0+cu130, and a constraint with that local label matches no distribution.
torch_version() { python -c 'from importlib.metadata import version; print(version("torch"))'; }
base_torch=$(torch_version)
echo "[image] 1/4 pinned packages (gpu + both); the base has torch $base_torch ..."
PIP_CONSTRAINT=/dev/null "${pip[@]}" -r "$REQ/gpu-requirements.txt"
final_torch=$(torch_version)
if [[ "$final_torch" != "$base_torch" ]]; then
    echo "[image] NOTE: vLLM replaced the base's torch $base_torch with $final_torch; what the base compiled" \
         "against its torch (apex) is checked by the self-test"
fi
# transformer_engine_cu13 and vLLM's cu13 extras need a CUDA 13 torch (PyPI's torch 2.13.0 is one).
torch_cuda=$(python -c 'import torch; print(torch.version.cuda or "none")')
[[ "$torch_cuda" == 13.* ]] || { echo "error: torch $final_torch is built for CUDA $torch_cuda, but the image's" \
    "Transformer Engine (core_cu13) and vLLM need CUDA 13" >&2; exit 1; }
echo "torch==${final_torch}" > "$REQ/torch-constraint.txt"
echo "[image] 2/4 Transformer Engine and fla against torch $final_torch (no build isolation) ..."
# NVTE_PYTORCH_FORCE_BUILD: on an NGC base TE's setup first fetches a prebuilt extension named for
# the base's own torch, which step 1 may have replaced; build against the torch that is installed.
NVTE_PYTORCH_FORCE_BUILD=TRUE PIP_CONSTRAINT=/dev/null "${pip[@]}" --no-build-isolation -c "$REQ/torch-constraint.txt" \
    -r "$REQ/gpu-late-requirements.txt"
echo "[image] 3/4 megatron-core (--no-deps: its metadata asks for a newer Python than some bases have) ..."
"${pip[@]}" --no-deps --ignore-requires-python -r "$REQ/nodeps-requirements.txt"
echo "[image] 4/4 megatron-rl (editable: the sbatch template in slurm/ and the recipes stay beside the code) ..."
"${pip[@]}" --no-deps --no-build-isolation -e "$SRC"
rm -rf "$WHEELS"
[[ "$(torch_version)" == "$final_torch" ]] || { echo "error: torch moved after step 1" >&2; exit 1; }
python -c "import megatron_rl, megatron.core, vllm, transformer_engine.pytorch, fla" \
    || { echo "error: the image does not import" >&2; exit 1; }
echo "[image] done"
