#!/usr/bin/env bash
# Runs every test against the real Docker engine, real sockets and real MCP servers.
# As root (CI, a fresh machine): installs what is needed, creates the service user and runs
# the tests as that user. As a non-root user with Docker access: runs them as yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
if [ "$(id -u)" -eq 0 ]; then
  # What the build makes is handed to the service user: readable by it whatever root's umask.
  umask 022
  # From a clone the service user cannot read (under /root or a `mktemp -d`: 0700), the
  # tests run from a mirror of it that it can (scripts/reachable-source.sh).
  if [ -z "${ROUNDTABLE_MIRRORED_FROM:-}" ]; then
    # The base (the service user, which the mirror's check needs); the tests' packages and
    # venvs below, in the tree the tests run from (venvs built once, there).
    id "${ROUNDTABLE_USER:-roundtable}" >/dev/null 2>&1 || scripts/setup.sh
    src=$(scripts/reachable-source.sh)
    if [ "$src" != "$(pwd -P)" ]; then
      echo "== running from $src (a mirror of this clone the service user can read)" >&2
      ROUNDTABLE_MIRRORED_FROM="$PWD" exec "$src/scripts/test.sh" "$@"
    fi
  fi
  # --tests: what only the tests use (ngIRCd, ii, Prometheus, debootstrap, PostgreSQL, the
  # MCP servers' venv and the Synapse homeserver's, which the Matrix bot's tests run).
  scripts/setup.sh --tests --gvisor
  export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$PWD/scripts/as-service-user.sh"
else
  scripts/synapse-venv.sh
fi
# Free space where the build goes, for a run that fails for want of it.
echo "== disk: $(df -h --output=avail "$PWD" | tail -1 | tr -d ' ') free for target/" >&2
echo "== format and lints" >&2
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
# The API a bot author gets: the two library crates, the CLI and the bots alone, without the
# `testing` feature (no dev-dependency, no test-support), so an item only tests use shows up.
shipped=(-p roundtable-sandbox -p roundtable-sandbox-actors -p roundtable-sandbox-cli -p roundtable-sandbox-examples -p roundtable-sandbox-metrics)
cargo clippy "${shipped[@]}" --lib --bins --quiet -- -D warnings
# And the libraries as a bot author builds them, alone, with their default features (no
# `cli` either, which the CLI's build unifies in): an item only the CLI uses shows up too.
for lib in roundtable-sandbox roundtable-sandbox-actors roundtable-sandbox-metrics; do
  cargo clippy -p "$lib" --lib --quiet -- -D warnings
done
# The public API (issue 44): every type it takes or returns can be named and no `pub` item is
# unreachable, in the library crates built as a bot author builds them (no `testing`); a crate
# that uses only it (a key provider, the audit stats) builds; the docs have no broken or
# private intra-doc link.
for lib in roundtable-sandbox roundtable-sandbox-actors roundtable-sandbox-metrics roundtable-sandbox-protocol; do
  cargo rustc -p "$lib" --lib --quiet -- -D unnameable_types -D unreachable_pub
done
cargo check -p roundtable-sandbox-api-check --quiet
RUSTDOCFLAGS="-D rustdoc::broken_intra_doc_links -D rustdoc::private_intra_doc_links" \
  cargo doc --no-deps --quiet -p roundtable-sandbox -p roundtable-sandbox-actors \
  -p roundtable-sandbox-metrics -p roundtable-sandbox-protocol
# (The Matrix bot, a crate of its own that nothing else compiles, is checked here too.)
if cargo tree "${shipped[@]}" -p roundtable-sandbox-matrix-bot -e normal,build,features -i roundtable-sandbox | grep -q 'feature "testing"'; then
  echo "a build of the CLI and the bots enables roundtable-sandbox's testing feature (cargo tree -e normal,build,features -i roundtable-sandbox)" >&2
  exit 1
fi
echo "== guest image" >&2
scripts/build-image.sh
scripts/build-hostile-image.sh
echo "== MCP servers' image" >&2
scripts/build-mcp-image.sh
echo "== tests" >&2
cargo test --workspace --no-fail-fast "$@"
# The bench is not a test target (`cargo test` does not build it); its statistics (the
# balanced orders, the 95 % intervals its verdicts print) have unit tests of their own.
echo "== the bench's own unit tests" >&2
cargo test --workspace --no-fail-fast --bin roundtable-bench
# The hostile guests again, each turn in a container prepared before its message (warm
# turns, on by default in the actor layer): the same attacks, the same results.
echo "== hostile guests through prepared containers (ROUNDTABLE_WARM=1)" >&2
ROUNDTABLE_WARM=1 cargo test --workspace --no-fail-fast --test security_guest "$@"
# The same binaries again with every guest container under gVisor (runsc): the sealed turn,
# the agent end to end, the hostile guests, the quota's attacks (gVisor counts held files
# inside the sandbox: a path of its own), the runtime's own tests and warm turns (prepared
# containers: adoption, faults, bounds).
gvisor_listed() { docker info --format '{{range $n, $_ := .Runtimes}}{{$n}} {{end}}' | tr ' ' '\n' | grep -qx runsc; }
if gvisor_listed; then
  echo "== tests under gVisor (ROUNDTABLE_RUNTIME=runsc)" >&2
  started=$SECONDS
  # --workspace keeps the features of the run above (one package alone would unify fewer
  # features and rebuild the crate and its dependants: minutes on a busy machine).
  ROUNDTABLE_RUNTIME=runsc cargo test --workspace --no-fail-fast \
    --test sealed_turn --test agent_e2e --test security_guest --test security_broker \
    --test security_quota --test runtime --test warm --test host_dirs --test host_process "$@"
  # The MCP servers' containers follow the configured runtime too.
  ROUNDTABLE_RUNTIME=runsc cargo test --workspace --no-fail-fast --test broker "$@" -- mcp_confined
  echo "== gVisor pass: $((SECONDS - started)) s" >&2
elif [ "${ROUNDTABLE_SKIP_GVISOR:-0}" = 1 ]; then
  echo "== tests under gVisor SKIPPED (ROUNDTABLE_SKIP_GVISOR=1)" >&2
else
  echo "the engine does not list runsc: run scripts/setup.sh --gvisor as root (or set ROUNDTABLE_SKIP_GVISOR=1 to skip the gVisor pass)" >&2
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  echo "== doctor, run as root, refuses root" >&2
  if out=$(target/debug/roundtable-sandbox doctor 2>&1); then
    echo "doctor passed as root: $out" >&2; exit 1
  fi
  grep -q "FAIL user            running as root" <<<"$out" || { echo "$out" >&2; exit 1; }
fi
