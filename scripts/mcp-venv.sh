#!/usr/bin/env bash
# Makes the Python venv with the MCP servers the broker tests talk to (idempotent).
#   scripts/mcp-venv.sh            -> <repo>/.venv-mcp (or $ROUNDTABLE_MCP_VENV)
# The tests find `$ROUNDTABLE_MCP_VENV/bin/mcp-server-time` (default: <repo>/.venv-mcp).
# The tests run as the non-root service user, so the venv is built on the system Python
# (/usr/bin/python3 when there is one: a pyenv under /root is not reachable for that user)
# and made world-readable.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ROUNDTABLE_MCP_VENV:-$repo/.venv-mcp}"
python="${ROUNDTABLE_PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x /usr/bin/python3 ]]; then python=/usr/bin/python3; else python=python3; fi
fi
base="$(readlink -f "$python" 2>/dev/null || command -v "$python")"
if [[ -x "$venv/bin/mcp-server-time" && -x "$venv/bin/mcp-server-git" ]] &&
    [[ "$(readlink -f "$venv/bin/python3")" == "$base" ]]; then
    echo "mcp venv ready: $venv"
    exit 0
fi
if [[ -f "$venv/pyvenv.cfg" ]]; then rm -rf "$venv"; fi
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check mcp-server-time mcp-server-git
chmod -R a+rX "$venv"
test -x "$venv/bin/mcp-server-time"
echo "mcp venv ready: $venv"
