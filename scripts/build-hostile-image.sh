#!/usr/bin/env bash
# Builds the hostile guest image FROM scratch for the security suite (tests/security_*.rs):
# the static hostile program (tests/support/hostile_guest.rs, compiled with rustc alone),
# a setuid-root copy of it, a root-only file, the static busybox, and the real static guest
# (/roundtable-guest): the tests run every attack as `/roundtable-guest --exec …`, under the
# seccomp layer the real guest installs, as every process of a real turn runs. No registry
# is used.
# Usage: scripts/build-hostile-image.sh [image-tag]
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-${ROUNDTABLE_HOSTILE_IMAGE:-roundtable-sandbox-hostile:latest}}"
busybox="${BUSYBOX:-/bin/busybox}"
ldd_out=$(ldd "$busybox" 2>&1 || true)
if [ ! -x "$busybox" ] || [[ "$ldd_out" != *"not a dynamic executable"* && "$ldd_out" != *"statically linked"* ]]; then
  echo "build-hostile-image: $busybox is not a static busybox (install busybox-static)" >&2
  exit 1
fi
out=target/hostile
mkdir -p "$out"
bin="$out/roundtable-hostile"
if [ ! -x "$bin" ] || [ tests/support/hostile_guest.rs -nt "$bin" ]; then
  echo "build-hostile-image: compiling the hostile guest" >&2
  rustc --edition 2021 -O -C target-feature=+crt-static --target x86_64-unknown-linux-gnu \
    -o "$bin" tests/support/hostile_guest.rs
fi
# The real guest, built as scripts/build-image.sh builds it.
quiet="${CARGO_QUIET---quiet}"
RUSTFLAGS='-C target-feature=+crt-static' cargo build $quiet --release \
  --target x86_64-unknown-linux-gnu -p roundtable-sandbox-guest
guest=target/x86_64-unknown-linux-gnu/release/roundtable-guest
ctx="$out/image-context"
rm -rf "$ctx" && mkdir -p "$ctx/bin" "$ctx/tmp" "$ctx/workspace" "$ctx/run/roundtable" "$ctx/etc"
chmod 1777 "$ctx/tmp"
cp "$busybox" "$ctx/bin/busybox"
for applet in $("$busybox" --list); do
  [ "$applet" = busybox ] || ln -s busybox "$ctx/bin/$applet"
done
cp "$bin" "$ctx/roundtable-hostile"
cp "$guest" "$ctx/roundtable-guest"
# The escalation bait: a setuid-root program and a file only root may read. The build
# runs as root, so the copied files are owned by root in the image.
cp "$bin" "$ctx/bin/suid-hostile"
cp "$busybox" "$ctx/bin/busybox-suid"
printf 'ROOT-ONLY-SECRET\n' > "$ctx/root-only"
printf 'root:x:0:0:root:/nonexistent:/bin/false\n' > "$ctx/etc/passwd"
printf 'root:x:0:\n' > "$ctx/etc/group"
cat > "$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY . /
# The storage driver may drop the setuid bit on COPY: set it in the image itself.
RUN ["/bin/busybox", "chmod", "4755", "/bin/suid-hostile", "/bin/busybox-suid"]
ENV PATH=/bin
WORKDIR /workspace
ENTRYPOINT ["/roundtable-guest", "--exec", "/roundtable-hostile"]
LABEL org.opencontainers.image.title="roundtable-sandbox hostile guest (tests only)"
DOCKERFILE
printf 'Dockerfile\n' > "$ctx/.dockerignore"
chmod 0400 "$ctx/root-only"
DOCKER_BUILDKIT=0 docker build --quiet -t "$tag" "$ctx" >/dev/null
echo "build-hostile-image: built $tag" >&2
