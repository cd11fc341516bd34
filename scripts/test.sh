#!/usr/bin/env bash
# Runs every test against the real Docker engine, real sockets and real MCP servers.
# As root (CI, a fresh machine): installs what is needed, creates the service user and runs
# the tests as that user. As a non-root user with Docker access: runs them as yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
if [ "$(id -u)" -eq 0 ]; then
  scripts/setup.sh
  export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$PWD/scripts/as-service-user.sh"
fi
echo "== format and lints" >&2
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== guest image" >&2
scripts/build-image.sh
scripts/build-hostile-image.sh
echo "== tests" >&2
cargo test --workspace --no-fail-fast "$@"
if [ "$(id -u)" -eq 0 ]; then
  echo "== doctor, run as root, refuses root" >&2
  if out=$(target/debug/roundtable-sandbox doctor 2>&1); then
    echo "doctor passed as root: $out" >&2; exit 1
  fi
  grep -q "FAIL user            running as root" <<<"$out" || { echo "$out" >&2; exit 1; }
fi
