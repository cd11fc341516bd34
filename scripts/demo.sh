#!/usr/bin/env bash
# Runs the terminal demo bot in real sealed containers.
# As root on a fresh machine: installs what is needed, creates the non-root service user,
# builds the guest image, then runs the bot as that user (the runtime refuses root).
# Without OPENAI_API_KEY the embedded offline model is used. Extra flags go to the bot
# (see `--help`), e.g. --model gpt-4o-mini --model-url https://api.openai.com/v1
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -eq 0 ]; then
  scripts/setup.sh
fi
scripts/build-image.sh
cargo build --quiet -p roundtable-sandbox-examples --bin terminal-bot
cat >&2 <<'TXT'

  roundtable-sandbox demo: type lines like
    #general ann: hello
    #general ann: run: ls -la /workspace
    /reset #general      /stop #general      /status
  and Ctrl-D to quit.

TXT
exec scripts/as-service-user.sh target/debug/terminal-bot "$@"
