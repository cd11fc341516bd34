#!/usr/bin/env bash
# Makes the Python venv with the Synapse homeserver the Matrix bot's tests start (idempotent).
#   scripts/synapse-venv.sh        -> <repo>/.venv-synapse (or $ROUNDTABLE_SYNAPSE_VENV)
# The tests (matrix-bot/tests/) find `$ROUNDTABLE_SYNAPSE_VENV/bin/python` (default:
# <repo>/.venv-synapse) and run `python -m synapse.app.homeserver` on loopback with SQLite.
# Only the tests need it: scripts/test.sh installs it (setup.sh --synapse), the demo does not.
# The tests run as the non-root service user, so the venv is built on the system Python
# (/usr/bin/python3 when there is one: a pyenv under /root is not reachable for that user)
# and made world-readable. Synapse comes from PyPI (wheels: no compiler needed).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ROUNDTABLE_SYNAPSE_VENV:-$repo/.venv-synapse}"
python="${ROUNDTABLE_PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x /usr/bin/python3 ]]; then python=/usr/bin/python3; else python=python3; fi
fi
base="$(readlink -f "$python" 2>/dev/null || command -v "$python")"
# The version the tests were written against (1.163.x); a newer minor may change the admin
# API or the generated config.
spec="matrix-synapse>=1.163,<1.164"
ready() {
    [[ -x "$venv/bin/python" ]] && "$venv/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as m, sys
v = m.version("matrix-synapse").split(".")
sys.exit(0 if v[:2] == ["1", "163"] else 1)
PY
}
# A venv's scripts name its Python by absolute path: one moved or copied from elsewhere (a
# mirror renamed, say) is made anew.
moved() {
    local interp
    [[ -e "$venv/bin/pip" ]] || return 1
    interp="$(head -n1 "$venv/bin/pip")"; interp="${interp#\#!}"
    case "$interp" in
        "$venv"/bin/python*) [[ -x "$interp" ]] || return 0 ;;
        *) return 0 ;;
    esac
    return 1
}
if [[ -f "$venv/pyvenv.cfg" ]] && { moved || [[ "$(readlink -f "$venv/bin/python3")" != "$base" ]]; }; then
    echo "synapse venv: $venv was made at another path or on another Python; making it anew" >&2
    rm -rf "$venv"
fi
if [[ -f "$venv/pyvenv.cfg" ]] && ready; then
    echo "synapse venv ready: $venv"
    exit 0
fi
[[ -f "$venv/pyvenv.cfg" ]] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$spec"
chmod -R a+rX "$venv"
ready || { echo "synapse venv: matrix-synapse 1.163 is not importable in $venv" >&2; exit 1; }
echo "synapse venv ready: $venv ($("$venv/bin/python" -c 'import importlib.metadata as m; print("matrix-synapse", m.version("matrix-synapse"))'))"
