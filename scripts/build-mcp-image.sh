#!/usr/bin/env bash
# Builds the image stdio MCP servers run in (each session its own confined container, see
# docs/security.md#mcp-servers): a minimal Debian bookworm root made by debootstrap, with
# python3 and git, and in it, from PyPI, mcp-server-time and mcp-server-git (/opt/mcp) and
# mcp-server-sqlite 2025.4.25 on "mcp>=1.6,<2" in a venv of its own (/opt/mcp-sqlite; see
# scripts/mcp-venv.sh for why), all on PATH in /usr/local/bin, plus the project's scripted
# test servers (tests/support/*.py) in /opt/roundtable-tests, and the static guest program
# at /roundtable-guest: under gVisor the host counts a session's deleted-but-open files with
# it (`--held-files /data`, docs/security.md#mcp-servers; built as scripts/build-image.sh
# builds it). No registry is pulled: the root is tarred and `docker import`ed. Run as root
# (debootstrap, chroot).
# The root's tarball is cached in $ROUNDTABLE_CACHE (default /var/cache/roundtable-sandbox)
# under the hash of this script and the test servers, so a later run takes seconds; an
# image already carrying that hash is kept as is.
# Usage: scripts/build-mcp-image.sh [image-tag]
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-${ROUNDTABLE_MCP_IMAGE:-roundtable-sandbox-mcp:latest}}"
cache="${ROUNDTABLE_CACHE:-/var/cache/roundtable-sandbox}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
hash=$(cat "$0" tests/support/*.py | sha256sum | cut -c1-16)
# The measurer: the same static build as the guest image's.
quiet="${CARGO_QUIET---quiet}"
RUSTFLAGS='-C target-feature=+crt-static' cargo build $quiet --release \
  --target x86_64-unknown-linux-gnu -p roundtable-sandbox-guest
guest=target/x86_64-unknown-linux-gnu/release/roundtable-guest
label="$hash-$(sha256sum "$guest" | cut -c1-16)"
have=$(docker image inspect -f '{{index .Config.Labels "roundtable-sandbox.mcp-image"}}' "$tag" 2>/dev/null || true)
if [ "$have" = "$label" ]; then
  echo "build-mcp-image: $tag is up to date ($label)" >&2
  exit 0
fi
tarball="$cache/mcp-rootfs-$hash.tar"
if [ ! -f "$tarball" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "build-mcp-image: run as root the first time (debootstrap and chroot)" >&2
    exit 1
  fi
  command -v debootstrap >/dev/null || { echo "build-mcp-image: install debootstrap (scripts/setup.sh --tests)" >&2; exit 1; }
  mkdir -p "$cache"
  root=$(mktemp -d "$cache/rootfs.XXXXXX")
  cleanup() {
    umount "$root/proc" 2>/dev/null || true
    rm -rf "$root"
  }
  trap cleanup EXIT
  # The Debian base alone is cached too (the slow part): a failed pip step redoes only itself.
  base="$cache/mcp-debootstrap-bookworm.tar"
  if [ ! -f "$base" ]; then
    echo "build-mcp-image: debootstrap bookworm (a few minutes the first time)" >&2
    debootstrap --variant=minbase --include=python3,python3-venv,git,ca-certificates \
      bookworm "$root" "$mirror" >/dev/null
    tar -C "$root" --numeric-owner -cf "$base.part" . && mv "$base.part" "$base"
  else
    tar -C "$root" --numeric-owner -xf "$base"
  fi
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  mount -t proc proc "$root/proc"
  # The wheels are fetched by the build host's pip (its proxy and CA settings; the host is
  # bookworm's Python 3.11 too, or says so below) and installed offline in the root.
  pyv=$(chroot "$root" /usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  hostv=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$pyv" = "$hostv" ] || { echo "build-mcp-image: host Python $hostv is not the root's $pyv" >&2; exit 1; }
  mkdir -p "$root/tmp/wheels/mcp" "$root/tmp/wheels/sqlite"
  dl=(-m pip download --quiet --disable-pip-version-check --no-cache-dir)
  python3 "${dl[@]}" --dest "$root/tmp/wheels/mcp" mcp-server-time mcp-server-git
  python3 "${dl[@]}" --dest "$root/tmp/wheels/sqlite" "mcp>=1.6,<2" mcp-server-sqlite==2025.4.25
  pipq=(-m pip install --quiet --no-cache-dir --disable-pip-version-check --no-index)
  chroot "$root" /usr/bin/python3 -m venv /opt/mcp
  chroot "$root" /opt/mcp/bin/python "${pipq[@]}" --find-links /tmp/wheels/mcp mcp-server-time mcp-server-git
  chroot "$root" /usr/bin/python3 -m venv /opt/mcp-sqlite
  chroot "$root" /opt/mcp-sqlite/bin/python "${pipq[@]}" --find-links /tmp/wheels/sqlite "mcp>=1.6,<2" mcp-server-sqlite==2025.4.25
  rm -rf "$root/tmp/wheels"
  for b in mcp-server-time mcp-server-git; do ln -s "/opt/mcp/bin/$b" "$root/usr/local/bin/$b"; done
  ln -s /opt/mcp-sqlite/bin/mcp-server-sqlite "$root/usr/local/bin/mcp-server-sqlite"
  mkdir -p "$root/opt/roundtable-tests" "$root/data"
  cp tests/support/*.py "$root/opt/roundtable-tests/"
  chmod -R a+rX "$root/opt"
  umount "$root/proc"
  # Small-ish: no apt lists or caches, docs, man pages, locales, pip caches.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
    "$root"/root/.cache "$root"/etc/resolv.conf
  find "$root/opt" -name __pycache__ -prune -exec rm -rf {} +
  : > "$root/etc/resolv.conf"
  tar -C "$root" --numeric-owner -cf "$tarball.part" .
  mv "$tarball.part" "$tarball"
  # Older tarballs of this script are stale.
  find "$cache" -maxdepth 1 -name 'mcp-rootfs-*.tar' ! -name "mcp-rootfs-$hash.tar" -delete
fi
echo "build-mcp-image: importing $tag" >&2
# The cached root plus the measurer, owned by root, mode 0755.
layered=$(mktemp "$cache/mcp-import.XXXXXX.tar")
trap 'rm -f "$layered"; { declare -F cleanup >/dev/null && cleanup; } || true' EXIT
cp "$tarball" "$layered"
tar -C "$(dirname "$guest")" --numeric-owner --owner=0 --group=0 --mode=0755 \
  -rf "$layered" roundtable-guest
docker import \
  --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'WORKDIR /data' \
  --change 'CMD ["/bin/sh"]' \
  --change "LABEL roundtable-sandbox.mcp-image=$label" \
  "$layered" "$tag" >/dev/null
rm -f "$layered"
echo "build-mcp-image: $tag ready ($(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec))" >&2
