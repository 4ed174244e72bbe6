#!/usr/bin/env bash
# Fill the image build's optional inputs from this host, before `podman-compose ... build`
# on a machine without a registry (compose/README.md, "Without a registry"):
#
#   compose/ca-certificates/  the host's extra CA certificates (/usr/local/share/ca-certificates),
#                             for a TLS-intercepting proxy between the build and PyPI
#   compose/wheels/           torch 2.13.0's CPU wheel: TORCH_WHEEL=/path/to/it.whl, or the one
#                             in pip's find-links (pip config get global.find-links)
#
# Both folders keep their files out of git. Fails when no CPU wheel is found: local.env has pip
# resolve torch's dependencies on PyPI, where torch itself is the multi-GB CUDA build.
# A file already there and the same is left alone, and copies keep their times (cp -p): the
# image build's layer cache hashes them, and a fresh time would rebuild every later layer.
set -euo pipefail
shopt -s nullglob
here=$(cd "$(dirname "$0")" && pwd)

sync_into() {  # DIR PATTERN FILE...: DIR holds exactly FILE... among the names matching PATTERN
    local dir=$1 pattern=$2 file kept
    shift 2
    for file in "$dir"/$pattern; do
        kept=
        for source in "$@"; do [ "$(basename "$source")" = "$(basename "$file")" ] && kept=1; done
        [ -n "$kept" ] || rm -f "$file"
    done
    for source in "$@"; do
        cmp -s "$source" "$dir/$(basename "$source")" || cp -p "$source" "$dir/"
    done
}

certs=(/usr/local/share/ca-certificates/*.crt /usr/local/share/ca-certificates/*/*.crt)
sync_into "$here/ca-certificates" '*.crt' "${certs[@]}"

wheel=${TORCH_WHEEL:-}
if [ -z "$wheel" ]; then
    for dir in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
        for candidate in "$dir"/torch-2.13.0+cpu-cp311-*.whl; do wheel=$candidate; done
    done
fi
if [ -z "$wheel" ] || [ ! -f "$wheel" ]; then
    echo "no torch 2.13.0 CPU wheel found: set TORCH_WHEEL=/path/to/torch-2.13.0+cpu-cp311-...whl" \
         "(from https://download.pytorch.org/whl/cpu/torch/)" >&2
    exit 1
fi
sync_into "$here/wheels" '*.whl' "$wheel"
echo "build context: ${#certs[@]} CA certificate(s), $(basename "$wheel")"
