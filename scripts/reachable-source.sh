#!/usr/bin/env bash
# Prints the source tree the tests must run from, as root, so that the service user can
# reach everything the tests hand it: the test binaries cargo runs through
# scripts/as-service-user.sh, the sources they read at run time (tests/support/*.py, named
# by CARGO_MANIFEST_DIR), the configs, the MCP venv (<tree>/.venv-mcp), the Synapse venv
# (<tree>/.venv-synapse) and the images' build contexts.
#   - the clone itself, when the service user can enter and read all of it (the usual case);
#   - else a mirror of it in a directory this setup owns and the service user can read:
#     ${ROUNDTABLE_MIRROR_ROOT:-/var/lib/roundtable-sandbox-tests}/<key>, the key the first 16
#     hex digits of the sha256 of the clone's path (or $ROUNDTABLE_MIRROR_KEY). The mirror
#     is the clone's files (without target/, .git, .venv-mcp and .venv-synapse), copied anew
#     on each run; its own target/ and venvs are kept between runs (an incremental build).
# No mode of the clone, of any directory above it or of any directory this script did not
# create is changed. When even the mirror is out of the service user's reach, it stops with
# one sentence naming the path and the fix.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
user="${ROUNDTABLE_USER:-roundtable}"
if [ "$(id -u)" -ne 0 ]; then echo "$repo"; exit 0; fi
as_user() { setpriv --reuid="$user" --regid="$user" --init-groups env HOME=/tmp "$@"; }

# The first path under $1 the service user cannot enter or read (nothing when it can read
# it all); target/, .git and the venvs are the build's own, not sources.
first_unreadable() {
  local out
  if ! out=$(as_user find "$1" \( -path "$1/target" -o -path "$1/.git" -o -path "$1/.venv-mcp" -o -path "$1/.venv-synapse" \) \
      -prune -o \( -type d ! -executable -o ! -readable \) -print -quit 2>/dev/null); then
    out="$1"
  fi
  printf '%s' "$out"
}

# The highest directory on the way to $1 that the service user cannot search.
blocked_at() {
  local d="" part
  IFS=/ read -ra parts <<<"${1#/}"
  for part in "${parts[@]}"; do
    d="$d/$part"
    as_user test -x "$d" || { printf '%s' "$d"; return; }
  done
  printf '%s' "$1"
}

blocked=$(first_unreadable "$repo")
if [ -z "$blocked" ]; then echo "$repo"; exit 0; fi

root="${ROUNDTABLE_MIRROR_ROOT:-/var/lib/roundtable-sandbox-tests}"
key="${ROUNDTABLE_MIRROR_KEY:-$(printf '%s' "$repo" | sha256sum | cut -c1-16)}"
mirror="$root/$key"
echo "reachable-source: the service user $user cannot read $blocked; mirroring $repo to $mirror" >&2
umask 022
# Created readable by all (the service user must enter them); an existing one is left as it is.
[ -d "$mirror" ] || install -d -m 0755 "$mirror"
unreachable() {
  echo "reachable-source: the service user $user cannot reach $(blocked_at "$1") (on the way to the mirror $mirror): let it search that directory, or set ROUNDTABLE_MIRROR_ROOT to a directory it can reach" >&2
  exit 1
}
as_user test -x "$mirror" || unreachable "$mirror"
find "$mirror" -mindepth 1 -maxdepth 1 ! -name target ! -name .venv-mcp ! -name .venv-synapse -exec rm -rf {} +
# Modification times are kept: cargo rebuilds only what changed since the last run.
tar -C "$repo" --exclude=./target --exclude=./.git --exclude=./.venv-mcp --exclude=./.venv-synapse -cf - . \
  | tar -C "$mirror" --no-same-owner -xf -
# The copy is this setup's: readable by the service user whatever the clone's modes were.
find "$mirror" -mindepth 1 -maxdepth 1 ! -name target ! -name .venv-mcp ! -name .venv-synapse \
  -exec chmod -R u+rwX,go+rX,go-w {} +

blocked=$(first_unreadable "$mirror")
[ -z "$blocked" ] || unreachable "$blocked"
echo "$mirror"
