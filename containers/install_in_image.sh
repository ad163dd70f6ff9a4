#!/usr/bin/env bash
# Runs inside the image build (Apptainer %post, Docker RUN): the pinned GPU stack, then this
# project. The requirement files and the mode were written by containers/build.sh from
# requirements/pins.txt (scopes gpu + both, and nodeps), so no version is written here.
#   install_in_image.sh SRC_DIR WHEEL_DIR
set -euo pipefail
SRC=${1:?usage: install_in_image.sh SRC_DIR WHEEL_DIR}
WHEELS=${2:?usage: install_in_image.sh SRC_DIR WHEEL_DIR}
REQ="$SRC/requirements/container"

for f in gpu-requirements.txt nodeps-requirements.txt mode; do
    [[ -f "$REQ/$f" ]] || { echo "error: $REQ/$f missing; build with containers/build.sh" >&2; exit 1; }
done
pip=(python -m pip install --no-cache-dir --disable-pip-version-check)
if [[ "$(cat "$REQ/mode")" == offline ]]; then
    # Air-gapped: only the wheels build.sh copied in (from `build.sh --offline WHEELDIR`).
    pip+=(--no-index --find-links "$WHEELS")
fi
echo "[image] pinned packages (gpu + both) ..."
"${pip[@]}" -r "$REQ/gpu-requirements.txt"
echo "[image] megatron-core (--no-deps: its metadata asks for a newer Python than some bases have) ..."
"${pip[@]}" --no-deps --ignore-requires-python -r "$REQ/nodeps-requirements.txt"
echo "[image] megatron-rl (editable: the sbatch template in slurm/ and the recipes stay beside the code) ..."
"${pip[@]}" --no-deps --no-build-isolation -e "$SRC"
rm -rf "$WHEELS"
python -c "import megatron_rl, megatron.core, vllm" || { echo "error: the image does not import" >&2; exit 1; }
echo "[image] done"
