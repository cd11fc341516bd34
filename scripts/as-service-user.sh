#!/usr/bin/env bash
# Runs a command as the non-root service user (cargo's test runner when tests start as root).
set -euo pipefail
user="${ROUNDTABLE_USER:-roundtable}"
if [ "$(id -u)" -ne 0 ]; then exec "$@"; fi
exec setpriv --reuid="$user" --regid="$user" --init-groups env HOME=/tmp USER="$user" "$@"
