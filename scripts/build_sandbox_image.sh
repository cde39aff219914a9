#!/usr/bin/env bash
# Build the default sandbox image from Debian packages, without any registry:
# mmdebstrap makes a minimal bookworm root with python3, a `sandbox` user with
# uid/gid 1000 is added (the runner starts every container as 1000:1000, so
# files it creates have a named owner), and `docker import` turns the tarball
# into an image. Idempotent: an existing image is left alone unless --force.
#
#   scripts/build_sandbox_image.sh [IMAGE] [--force]     (default governance-sandbox:bookworm)
set -euo pipefail

IMAGE="governance-sandbox:bookworm"
FORCE=""
for arg in "$@"; do
    case "$arg" in
        --force) FORCE=1 ;;
        *) IMAGE="$arg" ;;
    esac
done
SUITE="${SANDBOX_SUITE:-bookworm}"
MIRROR="${SANDBOX_MIRROR:-http://deb.debian.org/debian}"

if [ -z "$FORCE" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "image $IMAGE already present: $(docker image inspect -f '{{.Id}}' "$IMAGE")"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# --variant=apt: essential + apt only; python3-minimal is all a script needs (and
# `mount`, so the probes can show that mounting is refused).
# The customize hook adds uid 1000 only if the root has no such user already.
mmdebstrap --quiet --variant=apt --include=python3-minimal,mount "$SUITE" "$work/root.tar" "$MIRROR" \
    --customize-hook='chroot "$1" sh -c "getent passwd 1000 >/dev/null || (groupadd -g 1000 sandbox && useradd -u 1000 -g 1000 -M -d /workspace -s /bin/sh sandbox)"' \
    --customize-hook='mkdir -p "$1/workspace" "$1/sandbox" && chown 1000:1000 "$1/workspace"' \
    --customize-hook='rm -rf "$1/var/cache/apt/archives"/*.deb "$1/var/lib/apt/lists"/*'
docker import \
    --change 'USER 1000:1000' \
    --change 'WORKDIR /workspace' \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin PYTHONDONTWRITEBYTECODE=1' \
    --change 'CMD ["python3"]' \
    "$work/root.tar" "$IMAGE" >/dev/null
echo "built $IMAGE: $(docker image inspect -f '{{.Id}}' "$IMAGE")"
