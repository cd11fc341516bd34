#!/usr/bin/env bash
# Builds the guest image FROM scratch: the static guest program and a static busybox.
# No registry is used. Usage: scripts/build-image.sh [image-tag]
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-${ROUNDTABLE_IMAGE:-roundtable-sandbox-guest:latest}}"
busybox="${BUSYBOX:-/bin/busybox}"
ldd_out=$(ldd "$busybox" 2>&1 || true)
if [ ! -x "$busybox" ] || [[ "$ldd_out" != *"not a dynamic executable"* && "$ldd_out" != *"statically linked"* ]]; then
  echo "build-image: $busybox is not a static busybox (install the Debian package busybox-static)" >&2
  exit 1
fi
echo "build-image: building the static guest" >&2
RUSTFLAGS='-C target-feature=+crt-static' cargo build --quiet --release \
  --target x86_64-unknown-linux-gnu -p roundtable-sandbox-guest
guest=target/x86_64-unknown-linux-gnu/release/roundtable-guest
ctx=target/image-context
rm -rf "$ctx" && mkdir -p "$ctx/bin" "$ctx/tmp" "$ctx/workspace" "$ctx/run/roundtable" "$ctx/etc"
chmod 1777 "$ctx/tmp"
cp "$guest" "$ctx/roundtable-guest"
cp "$busybox" "$ctx/bin/busybox"
for applet in $("$busybox" --list); do
  [ "$applet" = busybox ] || ln -s busybox "$ctx/bin/$applet"
done
# Names for the ids the container may run as; no shell, no home outside the workspace.
printf 'root:x:0:0:root:/nonexistent:/bin/false\nguest:x:%s:%s:guest:/workspace:/bin/false\n' \
  "${GUEST_UID:-1000}" "${GUEST_GID:-1000}" > "$ctx/etc/passwd"
printf 'root:x:0:\nguest:x:%s:\n' "${GUEST_GID:-1000}" > "$ctx/etc/group"
cat > "$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY . /
ENV PATH=/bin
WORKDIR /workspace
ENTRYPOINT ["/roundtable-guest"]
LABEL org.opencontainers.image.title="roundtable-sandbox guest"
DOCKERFILE
printf 'Dockerfile\n' > "$ctx/.dockerignore"
DOCKER_BUILDKIT=0 docker build --quiet -t "$tag" "$ctx" >/dev/null
echo "build-image: built $tag ($(stat -c %s "$guest") byte guest, $(docker image inspect -f '{{.Size}}' "$tag") byte image)" >&2
