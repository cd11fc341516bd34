#!/usr/bin/env bash
# Builds the guest image FROM scratch: the static guest program and a static busybox.
# No registry is used. Usage: scripts/build-image.sh [image-tag]
set -euo pipefail
cd "$(dirname "$0")/.."
# CARGO_QUIET= (empty) shows cargo's progress; the default keeps the tests' logs short.
quiet="${CARGO_QUIET---quiet}"
tag="${1:-${ROUNDTABLE_IMAGE:-roundtable-sandbox-guest:latest}}"
busybox="${BUSYBOX:-/bin/busybox}"
echo "build-image: building the static guest" >&2
RUSTFLAGS='-C target-feature=+crt-static' cargo build $quiet --release \
  --target x86_64-unknown-linux-gnu -p roundtable-sandbox-guest
guest=target/x86_64-unknown-linux-gnu/release/roundtable-guest
# The operator CLI assembles the context (Dockerfile, guest, busybox and its applets) and
# sends it to the engine's builder; it checks that both binaries are static.
cargo run $quiet -p roundtable-sandbox-cli -- image build --guest "$guest" --busybox "$busybox" --tag "$tag"
