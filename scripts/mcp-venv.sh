#!/usr/bin/env bash
# Makes the Python venv with the MCP servers the broker tests talk to (idempotent).
#   scripts/mcp-venv.sh            -> <repo>/.venv-mcp (or $ROUNDTABLE_MCP_VENV)
# The tests find `$ROUNDTABLE_MCP_VENV/bin/mcp-server-time` and `mcp-server-sqlite` (a
# stateful server, one SQLite file per `--db-path`: the per-channel MCP session tests)
# (default: <repo>/.venv-mcp). A venv on the right Python that lacks a server gets it added.
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
packages=(mcp-server-time mcp-server-git)
bins=(mcp-server-time mcp-server-git mcp-server-sqlite)
# mcp-server-sqlite 2025.4.25 uses the `mcp` 1.x server API (gone in 2.x, which the HTTP
# test server needs): it gets its own venv inside this one, reached by a link in bin/.
sqlite_venv="$venv/sqlite"
ready() { for b in "${bins[@]}"; do [[ -x "$venv/bin/$b" ]] || return 1; done; }
# A venv's scripts name its Python by absolute path: a venv moved or copied from elsewhere
# (a mirror renamed, say) has servers that cannot start. Such a venv is made anew.
moved() {
    local b interp
    for b in "$venv/bin/mcp-server-time" "$sqlite_venv/bin/mcp-server-sqlite"; do
        [[ -e "$b" ]] || continue
        interp="$(head -n1 "$b")"; interp="${interp#\#!}"
        case "$interp" in
            "$venv"/bin/python*|"$sqlite_venv"/bin/python*) [[ -x "$interp" ]] || return 0 ;;
            *) return 0 ;;
        esac
    done
    return 1
}
if [[ -f "$venv/pyvenv.cfg" ]] && moved; then
    echo "mcp venv: $venv was made at another path; making it anew" >&2
    rm -rf "$venv"
fi
if [[ -f "$venv/pyvenv.cfg" && "$(readlink -f "$venv/bin/python3")" == "$base" ]]; then
    if ready; then
        echo "mcp venv ready: $venv"
        exit 0
    fi
else
    if [[ -f "$venv/pyvenv.cfg" ]]; then rm -rf "$venv"; fi
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${packages[@]}"
if [[ ! -x "$sqlite_venv/bin/mcp-server-sqlite" ]]; then
    rm -rf "$sqlite_venv"
    "$python" -m venv "$sqlite_venv"
    "$sqlite_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "mcp>=1.6,<2" mcp-server-sqlite==2025.4.25
fi
ln -sfn ../sqlite/bin/mcp-server-sqlite "$venv/bin/mcp-server-sqlite"
chmod -R a+rX "$venv"
ready
echo "mcp venv ready: $venv"
