#!/usr/bin/env bash
# Runs the benchmark: every figure next to its baseline, measured interleaved in one run.
#   scripts/bench.sh [roundtable-bench options]   e.g. --iterations 50 --only turn,broker
# Builds the guest image and the release bench binary, runs it as the non-root service user
# (the runtime refuses root), prints a table and writes target/bench/results.json.
# See docs/benchmarks.md for what is measured and the latest figures.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
if [ "$(id -u)" -eq 0 ]; then
  # --tests: `--only store` starts a PostgreSQL server from the package's binaries.
  scripts/setup.sh --tests
fi
if [ "${BENCH_SKIP_IMAGE:-0}" != 1 ]; then
  scripts/build-image.sh
fi
echo "== building the bench (release)" >&2
cargo build --quiet --release -p roundtable-bench
mkdir -p target/bench
# The bench writes its JSON as the service user.
if [ "$(id -u)" -eq 0 ]; then chown "${ROUNDTABLE_USER:-roundtable}" target/bench; fi
out="$PWD/target/bench/results.json"
exec scripts/as-service-user.sh "$PWD/target/release/roundtable-bench" --json "$out" "$@"
