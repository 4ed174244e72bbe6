#!/usr/bin/env bash
# The images compose needs from a registry, made on a machine that can reach a Debian mirror
# but no image registry: Debian bookworm (its Python is 3.11, as the image needs) bootstrapped
# from the mirror this host's apt already uses, then imported as local images:
#
#   localhost/splitserve-base:bookworm    Python 3.11 with venv and headers, gcc, ca-certificates:
#                                         compose/Dockerfile's BASE_IMAGE (SPLITSERVE_BASE_IMAGE)
#   localhost/splitserve-redis:bookworm   the base plus Debian's redis-server (REDIS_IMAGE)
#   localhost/splitserve-prometheus:bookworm  the base plus Debian's prometheus and wget (PROMETHEUS_IMAGE)
#
#   compose/local-base.sh
#
# Needs root, debootstrap and podman (CONTAINER_RUNTIME=docker to import with docker).
# Images already there are kept (FORCE=1 makes them again); about 3 minutes cold.
# DEBIAN_MIRROR overrides the mirror read from /etc/apt/sources.list(.d); it goes into the
# image's apt sources only, never into the repository.
set -euo pipefail

runtime=${CONTAINER_RUNTIME:-podman}
suite=bookworm
base=localhost/splitserve-base:$suite
# image -> the Debian packages it adds to the base
declare -A extras=([localhost/splitserve-redis:$suite]=redis-server [localhost/splitserve-prometheus:$suite]='prometheus wget')

missing=()
for image in "$base" "${!extras[@]}"; do
    if [ -n "${FORCE:-}" ] || ! "$runtime" image inspect "$image" >/dev/null 2>&1; then missing+=("$image"); fi
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "the local images are already there (FORCE=1 makes them again)"
    exit 0
fi

host_mirror() {
    # The first Debian archive in the host's sources (deb822 .sources or one-line lists),
    # not the security archive.
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list)
    { grep -hsE '^(URIs:|deb )' "${files[@]}" || true; } \
        | sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//' \
        | awk '{print $1}' | grep -v -- '-security' | head -n1
}
mirror=${DEBIAN_MIRROR:-$(host_mirror)}
if [ -z "$mirror" ]; then
    echo "no Debian mirror in /etc/apt/sources.list(.d); set DEBIAN_MIRROR=http://deb.debian.org/debian" >&2
    exit 1
fi

rootfs=$(mktemp -d /var/tmp/splitserve-base.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
echo "bootstrapping Debian $suite from $mirror into $rootfs"
debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >/dev/null
apt_install() {
    chroot "$rootfs" /usr/bin/env DEBIAN_FRONTEND=noninteractive sh -c "
        apt-get update -qq &&
        apt-get install -y -qq --no-install-recommends $* >/dev/null &&
        apt-get clean && rm -rf /var/lib/apt/lists/*"
}
import_rootfs() {  # IMAGE [CMD as JSON]; only a missing one: re-importing the base would
    # give it a new id and void the layer cache of every image built on it.
    [[ " ${missing[*]} " == *" $1 "* ]] || return 0
    tar -C "$rootfs" -c . | "$runtime" import \
        --change "CMD ${2:-[\"/bin/bash\"]}" --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$1" >/dev/null
    echo "made $1"
}
# What the Dockerfile installs on its default base, so its apt step has nothing left to fetch.
apt_install python3.11 python3.11-venv python3.11-dev gcc libc6-dev ca-certificates
import_rootfs "$base"
# Prometheus runs as nobody (docker-compose.observability.yml): its storage, as the official
# image has it, belongs to that user, and so does a named volume mounted there.
install -d -o 65534 -g 65534 "$rootfs/prometheus"
# Each extra on top of the base, one after the other in the same tree (they are small).
for image in "${!extras[@]}"; do
    apt_install "${extras[$image]}"
    import_rootfs "$image"
done
