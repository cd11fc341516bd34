#!/usr/bin/env bash
# Installs what the demo needs on a fresh Debian machine, as root: the static busybox (the
# guest image's), setpriv, Docker, and the non-root service user (the runtime refuses root)
# with access to the Docker socket. Idempotent. Run as root.
#   --tests (or ROUNDTABLE_TESTS=1): also what only the tests use (scripts/test.sh asks for
#   it, the demo does not): ngIRCd and ii (the IRC example's end-to-end test), Prometheus
#   (the metrics' end-to-end test), debootstrap (the MCP servers' image), PostgreSQL's
#   server binaries (the budgets' shared store), python3-venv, and in this tree the MCP
#   servers' venv (scripts/mcp-venv.sh) and the Synapse homeserver's venv the Matrix bot's
#   tests start (scripts/synapse-venv.sh).
#   --gvisor (or ROUNDTABLE_GVISOR=1): also register gVisor's runsc with the engine
#   (scripts/setup-gvisor.sh: package, daemon.json, SIGHUP reload, never a restart).
#   --synapse (or ROUNDTABLE_SYNAPSE=1): the Synapse venv alone (--tests includes it).
set -euo pipefail
cd "$(dirname "$0")/.."
user="${ROUNDTABLE_USER:-roundtable}"
gvisor="${ROUNDTABLE_GVISOR:-0}"
synapse="${ROUNDTABLE_SYNAPSE:-0}"
tests="${ROUNDTABLE_TESTS:-0}"
for arg in "$@"; do
  case "$arg" in
    --tests) tests=1 ;;
    --gvisor) gvisor=1 ;;
    --synapse) synapse=1 ;;
    *) echo "setup: unknown argument $arg (known: --tests, --gvisor, --synapse)" >&2; exit 2 ;;
  esac
done
if [ "$tests" = 1 ]; then synapse=1; fi
if [ "$(id -u)" -ne 0 ]; then
  echo "setup: run as root (it installs packages and creates the service user $user)" >&2
  exit 1
fi
need=()
static_busybox() { [ -x /bin/busybox ] && { ldd /bin/busybox 2>&1 || true; } | grep -q "not a dynamic"; }
static_busybox || need+=(busybox-static)
command -v setpriv >/dev/null || need+=(util-linux)
command -v docker >/dev/null || need+=(docker.io)
# What only the tests use.
if [ "$tests" = 1 ] || [ "$synapse" = 1 ]; then
  python3 -m venv --help >/dev/null 2>&1 || need+=(python3-venv)   # the MCP and Synapse venvs
fi
if [ "$tests" = 1 ]; then
  [ -x /usr/sbin/ngircd ] || need+=(ngircd)   # the IRC example's end-to-end test
  command -v ii >/dev/null || need+=(ii)
  [ -x /usr/bin/prometheus ] || need+=(prometheus)   # the metrics test scrapes a bot with a real one
  command -v debootstrap >/dev/null || need+=(debootstrap)   # the MCP servers' image
  # The budgets' shared store's tests (and the bench's `--only store`) start their own
  # server from these binaries (as the service user, in a private data directory, on
  # loopback); the package's own cluster is not used.
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
docker_up() { for _ in $(seq "$1"); do docker info >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
if ! docker_up 1; then
  echo "setup: the Docker daemon is not answering; starting it" >&2
  service docker start >/dev/null 2>&1 || true
  if ! docker_up 20; then
    rm -f /var/run/docker.pid
    (setsid nohup dockerd >>/var/log/dockerd.log 2>&1 </dev/null &)
    docker_up 40 || { echo "setup: could not start the Docker daemon (see /var/log/dockerd.log)" >&2; exit 1; }
  fi
fi
getent group docker >/dev/null || groupadd --system docker
if ! id "$user" >/dev/null 2>&1; then
  useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "$user"
  echo "setup: created the service user $user" >&2
fi
sock="${DOCKER_HOST:-unix:///var/run/docker.sock}"; sock="${sock#unix://}"
sock_group=$(stat -c %G "$sock")
id -nG "$user" | tr ' ' '\n' | grep -qx "$sock_group" || usermod -aG "$sock_group" "$user"
if [ "$tests" = 1 ]; then scripts/mcp-venv.sh; fi
if [ "$synapse" = 1 ]; then scripts/synapse-venv.sh; fi
if [ "$gvisor" = 1 ]; then scripts/setup-gvisor.sh; fi
echo "setup: ready (service user $user: uid $(id -u "$user"), groups $(id -nG "$user"))" >&2
