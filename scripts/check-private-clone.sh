#!/usr/bin/env bash
# Checks the README's test command from a clone the service user cannot enter (issue 25):
# clones this repository's HEAD into a `mktemp -d` directory (0700, like /root), checks that
# the service user indeed cannot read it, then takes scripts/test.sh's own path from there:
# scripts/reachable-source.sh picks the tree to run from (a mirror the service user can
# read), and one representative test binary is built there and run the way test.sh runs
# every one, through cargo's runner scripts/as-service-user.sh by its absolute path. The
# binary (the broker tests' MCP-over-HTTP group) reads a support script by
# CARGO_MANIFEST_DIR (tests/support/mcp_http.py) and runs the MCP venv's Python: the three
# things the issue saw fail. A second whole suite would double CI's time (about 14 min);
# this takes the same path for one binary. Run as root; CI runs it after the suite.
#   ROUNDTABLE_MIRROR_KEY (default private-clone-check): the mirror's name, so its build is
#   kept between runs (incremental) although each run's clone has a new path.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
user="${ROUNDTABLE_USER:-roundtable}"
say() { echo "check-private-clone: $*" >&2; }
if [ "$(id -u)" -ne 0 ]; then say "run as root (the issue's setting: root's clone, the service user's tests)"; exit 1; fi
started=$SECONDS
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone --quiet --no-hardlinks "$repo" "$tmp/clone"
if "$repo/scripts/as-service-user.sh" test -r "$tmp/clone/Cargo.toml"; then
  say "the service user $user can read $tmp/clone (mode $(stat -c %a "$tmp")): this check proves nothing here"
  exit 1
fi
say "the service user $user cannot read $tmp/clone (its parent $tmp is $(stat -c %a "$tmp"))"
cd "$tmp/clone"
umask 022
src=$(ROUNDTABLE_MIRROR_KEY="${ROUNDTABLE_MIRROR_KEY:-private-clone-check}" scripts/reachable-source.sh)
if [ "$src" = "$(pwd -P)" ]; then say "reachable-source.sh kept the unreadable clone"; exit 1; fi
cd "$src"
# A first mirror's build starts from this clone's (dependencies are the same crates, built the
# same way; the workspace's own crates are rebuilt, their paths differ): minutes saved.
if [ ! -d target/debug ] && [ -d "$repo/target/debug" ]; then
  say "seeding the mirror's build from $repo/target/debug"
  mkdir -p target/debug
  tar -C "$repo/target/debug" --exclude=./incremental -cf - . | tar -C target/debug -xf -
fi
scripts/mcp-venv.sh >/dev/null
export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$src/scripts/as-service-user.sh"
export CARGO_TERM_COLOR=never
unset ROUNDTABLE_MCP_VENV
# --workspace: the features test.sh builds with (one package alone would unify fewer).
out=$(cargo test --quiet --workspace --test broker -- mcp_http 2>&1) || {
  printf '%s\n' "$out" >&2; say "FAILED from $src"; exit 1; }
printf '%s\n' "$out" | grep -E "^test result" >&2
passed=$(printf '%s\n' "$out" | sed -n 's/^test result: ok\. \([0-9]*\) passed.*/\1/p' | head -1)
if [ "${passed:-0}" -lt 1 ]; then printf '%s\n' "$out" >&2; say "no test ran"; exit 1; fi
say "ok: $passed test(s) passed from $src, built and run as $user ($((SECONDS - started)) s)"
