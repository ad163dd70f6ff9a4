#!/usr/bin/env bash
# System packages the tests need beyond Python: a one-node Slurm (slurm-wlm + munge) for the
# sbatch end-to-end tests and shellcheck for the rendered scripts and container recipes.
# Idempotent and quiet: a no-op when everything is installed; otherwise one apt-get install.
set -euo pipefail
PACKAGES=(slurm-wlm munge shellcheck)

missing=()
for pkg in "${PACKAGES[@]}"; do
    # dpkg-query prints "install ok installed" only for a fully installed package.
    if [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]]; then
        missing+=("$pkg")
    fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

command -v apt-get >/dev/null || {
    echo "error: missing system packages (${missing[*]}) and no apt-get to install them" >&2; exit 1; }
sudo=()
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "error: installing ${missing[*]} needs root (or sudo)" >&2; exit 1; }
    sudo=(sudo)
fi
echo "[install] system packages: ${missing[*]} ..."
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# No recommends: slurm-wlm's recommendations pull in mail and X11 bits the tests never use.
# apt's chatter goes to a log that is shown only when something fails.
if ! { "${sudo[@]}" apt-get update -q && \
       "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "error: apt-get could not install ${missing[*]} (output above)" >&2
    exit 1
fi
echo "[install] system packages done"
