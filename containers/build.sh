#!/usr/bin/env bash
# Build the megatron-rl image (Apptainer/Singularity .sif, or an OCI image with Docker).
#
#   containers/build.sh [-o OUT] [--runtime apptainer|singularity|docker] [--offline WHEELDIR]
#                       [--base-sif FILE] [--fakeroot]
#   containers/build.sh --download WHEELDIR [--runtime ...]   fill a wheel cache for --offline, then exit
#   containers/build.sh --stage DIR [--offline WHEELDIR]      only stage the build context (tests)
#
# The versions come from requirements/pins.txt, the pin file of the CPU environment too: this
# script cuts the image's scopes out of it (gpu + both -> gpu-requirements.txt, gpu-late ->
# gpu-late-requirements.txt, nodeps -> nodeps-requirements.txt) into a staged copy of the project,
# and the image installs exactly those, in that order (containers/install_in_image.sh).
# The base image is named once, on the `From:` line of containers/megatron-rl.def.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
DEF="$HERE/megatron-rl.def"
PINS="$ROOT/requirements/pins.txt"

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "build.sh: error: $*" >&2; exit 1; }

runtime="" out="" offline="" download="" stage="" base_sif="" fakeroot=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -o|--output) out=${2:?}; shift 2 ;;
        --runtime) runtime=${2:?}; shift 2 ;;
        --offline) offline=${2:?}; shift 2 ;;
        --download) download=${2:?}; shift 2 ;;
        --stage) stage=${2:?}; shift 2 ;;
        --base-sif) base_sif=${2:?}; shift 2 ;;
        --fakeroot) fakeroot=(--fakeroot); shift ;;
        -h|--help) usage ;;
        *) echo "build.sh: unknown option '$1'" >&2; usage ;;
    esac
done

base_image() {  # the def's `From:` line
    sed -n 's/^From:[[:space:]]*//p' "$DEF" | head -n 1
}

pins_for() {  # name==version of the given scopes (whole words: "gpu" is not "gpu-late")
    awk -v scopes=" $1 " '!/^#/ && NF >= 3 && index(scopes, " " $3 " ") { print $1 }' "$PINS"
}

pick_runtime() {
    if [[ -z "$runtime" ]]; then
        for r in apptainer singularity docker; do
            command -v "$r" >/dev/null 2>&1 && { runtime=$r; break; }
        done
        [[ -n "$runtime" ]] || die "none of apptainer, singularity, docker is installed"
    fi
    case "$runtime" in
        apptainer|singularity|docker) command -v "$runtime" >/dev/null 2>&1 || die "'$runtime' is not installed" ;;
        *) die "--runtime '$runtime' (allowed: apptainer, singularity, docker)" ;;
    esac
}

# stage_context DIR: the project, the requirement files cut from pins.txt, the wheel cache.
stage_context() {
    local dir=$1 req
    local -a paths=(pyproject.toml Makefile megatron_rl slurm recipes requirements containers tests)
    [[ -f "$ROOT/README.md" ]] && paths+=(README.md)      # pyproject's readme, once it exists
    mkdir -p "$dir/megatron-rl" "$dir/wheels"
    (cd "$ROOT" && tar --exclude=__pycache__ --exclude='*.pyc' --exclude=requirements/container -cf - "${paths[@]}") \
        | tar -xf - -C "$dir/megatron-rl"
    req="$dir/megatron-rl/requirements/container"
    mkdir -p "$req"
    pins_for "gpu both" > "$req/gpu-requirements.txt"
    pins_for "gpu-late" > "$req/gpu-late-requirements.txt"
    pins_for "nodeps" > "$req/nodeps-requirements.txt"
    [[ -s "$req/gpu-requirements.txt" ]] || die "no gpu/both pins in $PINS"
    if [[ -n "$offline" ]]; then
        [[ -d "$offline" ]] || die "--offline $offline: no such directory (fill one with --download)"
        cp -a "$offline"/. "$dir/wheels/"
        echo offline > "$req/mode"
    else
        echo online > "$req/mode"
    fi
    cp "$DEF" "$HERE/Dockerfile" "$dir/"
    if [[ -n "$base_sif" ]]; then
        # Air-gapped: the base as a local .sif (`apptainer pull` it where the registry is reachable).
        [[ -f "$base_sif" ]] || die "--base-sif $base_sif: no such file"
        base_sif=$(cd "$(dirname "$base_sif")" && pwd)/$(basename "$base_sif")
        sed -i -e 's|^Bootstrap:.*|Bootstrap: localimage|' -e "s|^From:.*|From: $base_sif|" "$dir/megatron-rl.def"
    fi
}

download_wheels() {  # pip download inside the base image, so the wheels fit its Python and platform
    local dir=$1 base
    base=$(base_image)
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    local req="$tmp/megatron-rl/requirements/container"
    local cmd="PIP_CONSTRAINT= python -m pip download -d /wheels -r /req/gpu-requirements.txt -r /req/gpu-late-requirements.txt && \
python -m pip download -d /wheels --no-deps -r /req/nodeps-requirements.txt"
    if [[ "$runtime" == docker ]]; then
        docker run --rm -v "$dir:/wheels" -v "$req:/req:ro" "$base" bash -c "$cmd"
    else
        "$runtime" exec --bind "$dir:/wheels" --bind "$req:/req" "docker://$base" bash -c "$cmd"
    fi
    echo "wheels for $(base_image) in $dir; build offline with: containers/build.sh --offline $dir"
}

if [[ -n "$stage" ]]; then
    stage_context "$stage"
    exit 0
fi
pick_runtime
tmp=$(mktemp -d "${TMPDIR:-/tmp}/megatron-rl-image.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
stage_context "$tmp"
if [[ -n "$download" ]]; then
    download_wheels "$download"
    exit 0
fi
if [[ "$runtime" == docker ]]; then
    out=${out:-megatron-rl:$(date +%Y%m%d)}
    docker build --build-arg "BASE_IMAGE=$(base_image)" -t "$out" -f "$tmp/Dockerfile" "$tmp"
else
    out=${out:-megatron-rl.sif}
    [[ "$out" == /* ]] || out="$PWD/$out"
    # %files paths are relative to the directory the build runs in: the staged context.
    (cd "$tmp" && "$runtime" build "${fakeroot[@]}" "$out" megatron-rl.def)
fi
echo "built $out from $(base_image) ($(cat "$tmp/megatron-rl/requirements/container/"{gpu,gpu-late}-requirements.txt | grep -c .) pinned packages + megatron-core)"
