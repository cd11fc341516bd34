#!/usr/bin/env bash
# Registers gVisor (`runsc`) with the Docker engine, as root. Idempotent.
#   scripts/setup-gvisor.sh          (also: scripts/setup.sh --gvisor, or ROUNDTABLE_GVISOR=1)
# 1. installs the Debian package `runsc` when it is missing;
# 2. merges the runtime into the engine's config (/etc/docker/daemon.json, or
#    ROUNDTABLE_DOCKER_CONFIG), keeping every other setting, with the arguments a sealed
#    turn needs: --network=none (the container has none anyway; without it runsc refuses to
#    start in the root network namespace) and --host-uds=open (the guest connects to its
#    broker socket, a host unix socket bind-mounted read-only);
# 3. when the file changed, reloads the engine with SIGHUP (never a restart: containers of
#    other work keep running) and waits until `docker info` lists the runtime.
set -euo pipefail
runtime="${ROUNDTABLE_GVISOR_RUNTIME:-runsc}"
config="${ROUNDTABLE_DOCKER_CONFIG:-/etc/docker/daemon.json}"
if [ "$(id -u)" -ne 0 ]; then
  echo "setup-gvisor: run as root (it installs runsc and edits $config)" >&2
  exit 1
fi
if ! command -v runsc >/dev/null; then
  echo "setup-gvisor: installing runsc" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runsc >/dev/null
fi
runsc_path=$(command -v runsc)
listed() { docker info --format '{{range $name, $_ := .Runtimes}}{{$name}} {{end}}' 2>/dev/null | tr ' ' '\n' | grep -qx "$runtime"; }
mkdir -p "$(dirname "$config")"
# Prints "changed" when the file was rewritten. Refuses a file that is not a JSON object.
changed=$(python3 - "$config" "$runtime" "$runsc_path" <<'PY'
import json, os, sys
path, name, binary = sys.argv[1:4]
want = {"path": binary, "runtimeArgs": ["--host-uds=open", "--network=none"]}
try:
    with open(path) as f:
        text = f.read()
except FileNotFoundError:
    text = ""
data = json.loads(text) if text.strip() else {}
if not isinstance(data, dict):
    sys.exit(f"setup-gvisor: {path} is not a JSON object")
runtimes = data.setdefault("runtimes", {})
if not isinstance(runtimes, dict):
    sys.exit(f"setup-gvisor: {path}: \"runtimes\" is not a JSON object")
if runtimes.get(name) == want:
    sys.exit(0)
runtimes[name] = want
tmp = path + ".roundtable-tmp"
with open(tmp, "w") as f:
    json.dump(data, f, indent=2)
    f.write("\n")
if os.path.exists(path):
    st = os.stat(path)
    os.chmod(tmp, st.st_mode & 0o7777)
os.replace(tmp, path)
print("changed")
PY
)
if [ "$changed" = changed ] || ! listed; then
  pid=$(cat /var/run/docker.pid 2>/dev/null || pidof dockerd || true)
  if [ -z "$pid" ]; then
    echo "setup-gvisor: dockerd is not running; start it to load $config" >&2
    exit 1
  fi
  echo "setup-gvisor: $config updated; reloading dockerd (pid $pid) with SIGHUP" >&2
  kill -HUP "$pid"
  for _ in $(seq 40); do listed && break; sleep 0.5; done
fi
if ! listed; then
  echo "setup-gvisor: docker info does not list the runtime $runtime after the reload (see the daemon's log)" >&2
  exit 1
fi
echo "setup-gvisor: the engine lists the runtime $runtime ($runsc_path --host-uds=open --network=none)" >&2
