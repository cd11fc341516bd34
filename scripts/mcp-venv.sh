#!/usr/bin/env bash
# Makes the Python venv with the MCP servers the broker tests talk to (idempotent).
#   scripts/mcp-venv.sh            -> /work/main/.venv-mcp (or $ROUNDTABLE_MCP_VENV)
# The tests find `$ROUNDTABLE_MCP_VENV/bin/mcp-server-time` (default: <repo>/.venv-mcp).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ROUNDTABLE_MCP_VENV:-$repo/.venv-mcp}"
if [[ -x "$venv/bin/mcp-server-time" && -x "$venv/bin/mcp-server-git" ]]; then
    echo "mcp venv ready: $venv"
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check mcp-server-time mcp-server-git
# The tests may run as another (non-root) user: keep the venv world-readable.
chmod -R a+rX "$venv"
test -x "$venv/bin/mcp-server-time"
echo "mcp venv ready: $venv"
