#!/usr/bin/env bash
# Runs the terminal demo bot in real sealed containers.
# As root on a fresh machine: installs what the demo needs (scripts/setup.sh without
# --tests: the static busybox, Docker, the non-root service user; none of the tests' packages
# or venvs), builds the guest image, then runs the bot as that user (the runtime refuses root).
# Without OPENAI_API_KEY the embedded offline model is used. Extra flags go to the bot
# (see `--help`), e.g. --model gpt-4o-mini --model-url https://api.openai.com/v1
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -eq 0 ]; then
  umask 022
  # From a clone the service user cannot read (under /root or a `mktemp -d`: 0700), the bot
  # is built and run from a mirror of it that it can (scripts/reachable-source.sh).
  # Setup runs once, here: the mirror's run (ROUNDTABLE_MIRRORED_FROM set) has it done.
  if [ -z "${ROUNDTABLE_MIRRORED_FROM:-}" ]; then
    scripts/setup.sh
    src=$(scripts/reachable-source.sh)
    if [ "$src" != "$(pwd -P)" ]; then
      echo "demo: running from $src (a mirror of this clone the service user can read)" >&2
      ROUNDTABLE_MIRRORED_FROM="$PWD" exec "$src/scripts/demo.sh" "$@"
    fi
  fi
fi
if [ ! -x target/debug/terminal-bot ]; then
  cat >&2 <<'TXT'
demo: the first run compiles the project (the static guest, the operator CLI and the bot)
      and builds the guest image: this takes several minutes; later runs take seconds.
TXT
fi
# Show cargo's progress (the image script is quiet by default, for the tests).
CARGO_QUIET= scripts/build-image.sh
echo "demo: building the terminal bot" >&2
cargo build -p roundtable-sandbox-examples --bin terminal-bot
cat >&2 <<'TXT'

  roundtable-sandbox demo: type lines like
    #general ann: hello
    #general ann: run: ls -la /workspace
    /reset #general      /stop #general      /status
  and Ctrl-D to quit.

TXT
exec scripts/as-service-user.sh target/debug/terminal-bot "$@"
