#!/usr/bin/env bash
# A head and two worker nodes on this machine, to try a multi-host sweep locally.
#
#   bash infra/local_cluster.sh up [HEAD_HOST WORKER1_HOST WORKER2_HOST]   # default rtx4090 rtx3090 rtx3090
#   EXPERTSWEEP_LOCAL_MODEL=NAME bash infra/local_cluster.sh up            # worker 1 also offers model:NAME
#   . /tmp/expertsweep-ray-local/client.env && python -m sweep --config search_spaces/smoke.yaml
#   bash infra/local_cluster.sh status
#   bash infra/local_cluster.sh down
#
# Each node is `ray start --block` with one CPU, host:NAME = 1, on 127.0.0.1 with free ports,
# started in a working directory of its own (no node sees another's files by a relative path) and
# its own temp folder (nodes of one machine must not share one: their runtime-env agents would
# unpack `ray job submit --working-dir` packages into the same place). The head also serves the
# job API on 127.0.0.1 (address in /tmp/expertsweep-ray-local/dashboard). `down` stops the nodes by their pids.
#
# Token authentication is on unless RAY_AUTH_MODE is set (disabled: off): the nodes use RAY_AUTH_TOKEN,
# RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token when one is set, else a token of this cluster generated into
# the state folder (auth_token, mode 600). A client (the driver, `ray job submit`) needs the token AND
# RAY_AUTH_MODE=token: `up` writes both, with RAY_ADDRESS, to client.env in the state folder.
# (Ray's gRPC servers listen on every interface whatever the node address: Ray turns --node-ip-address=127.0.0.1
# into the machine's own address; each socket is listed in infra/README.md, "Listening sockets"; the token is
# what keeps other machines out.)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
state="${EXPERTSWEEP_LOCAL_CLUSTER:-${TMPDIR:-/tmp}/expertsweep-ray-local}"
ray="$repo/.venv/bin/ray"; [ -x "$ray" ] || ray="$(command -v ray)"
py="$(dirname "$ray")/python"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}" RAY_USAGE_STATS_ENABLED=0 PATH="$(dirname "$ray"):$PATH"
free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

start_node() {  # index host resources-json-extra extra-args...
  local i="$1" host="$2" more="$3"; shift 3
  local tmp; tmp="$(mktemp -d /tmp/rl.XXXX)"   # short: Ray's socket paths have a length limit
  echo "$tmp" > "$state/node$i.tmp"
  mkdir -p "$tmp/cwd"
  (cd "$tmp/cwd" && exec setsid "$ray" start --block --node-ip-address=127.0.0.1 --num-cpus=1 --resources="{\"host:$host\": 1$more}" \
    --object-store-memory=200000000 --temp-dir="$tmp" --disable-usage-stats \
    --dashboard-agent-listen-port="$(free_port)" --dashboard-agent-grpc-port="$(free_port)" \
    --runtime-env-agent-port="$(free_port)" --metrics-export-port="$(free_port)" "$@" \
    > "$state/node$i.log" 2>&1) &
  echo $! > "$state/node$i.pid"
  for _ in $(seq 180); do
    grep -qs "Ray runtime started" "$state/node$i.log" && { echo "node $i (host:$host) up, pid $(cat "$state/node$i.pid")"; return; }
    kill -0 "$(cat "$state/node$i.pid")" 2>/dev/null || { tail -20 "$state/node$i.log" >&2; exit 1; }
    sleep 0.5
  done
  echo "node $i did not start, see $state/node$i.log" >&2; exit 1
}

case "${1:-}" in
  up)
    mkdir -p "$state"
    if ls "$state"/node*.pid >/dev/null 2>&1; then echo "already up; run: bash infra/local_cluster.sh down" >&2; exit 1; fi
    auth=""
    if [ "$RAY_AUTH_MODE" = token ]; then
      if [ -z "${RAY_AUTH_TOKEN:-}" ] && [ ! -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; then
        (umask 077; "$py" -c 'import secrets; print(secrets.token_hex(32))' > "$state/auth_token")
        export RAY_AUTH_TOKEN_PATH="$state/auth_token"
      fi
      if [ -n "${RAY_AUTH_TOKEN:-}" ]; then auth="RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$RAY_AUTH_TOKEN"
      else auth="RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"; fi
    else
      auth="RAY_AUTH_MODE=$RAY_AUTH_MODE"
    fi
    port="$(free_port)"; dash="$(free_port)"
    model=""; [ -n "${EXPERTSWEEP_LOCAL_MODEL:-}" ] && model=", \"model:$EXPERTSWEEP_LOCAL_MODEL\": 1"
    start_node 0 "${2:-rtx4090}" "" --head --port="$port" --include-dashboard=true --dashboard-host=127.0.0.1 \
      --dashboard-port="$dash" --ray-client-server-port="$(free_port)"
    start_node 1 "${3:-rtx3090}" "$model" --address="127.0.0.1:$port"
    start_node 2 "${4:-rtx3090}" "" --address="127.0.0.1:$port"
    echo "127.0.0.1:$port" > "$state/address"; echo "http://127.0.0.1:$dash" > "$state/dashboard"
    (umask 077; printf 'export %s RAY_ADDRESS=127.0.0.1:%s\n' "$auth" "$port" > "$state/client.env")
    echo "clients: . $state/client.env  (sets ${auth%%=*}=... and RAY_ADDRESS=127.0.0.1:$port)"
    echo "jobs: . $state/client.env && ray job submit --address http://127.0.0.1:$dash --working-dir . -- python sweep/pareto.py ... --mlflow-uri sqlite:///\$PWD/mlflow/mlflow.db" ;;
  status)
    for f in "$state"/node*.pid; do
      [ -e "$f" ] || { echo "not up"; exit 0; }
      if kill -0 "$(cat "$f")" 2>/dev/null; then echo "$(basename "$f" .pid): running (pid $(cat "$f"))"; else echo "$(basename "$f" .pid): gone"; fi
    done ;;
  down)
    for f in $(ls -r "$state"/node*.pid 2>/dev/null); do
      pid="$(cat "$f")"
      if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null || true
      fi
      tmp="$state/$(basename "$f" .pid).tmp"; [ -f "$tmp" ] && rm -rf "$(cat "$tmp")" "$tmp"
      rm -f "$f"
    done
    rm -f "$state/address" "$state/dashboard" "$state/client.env" "$state/auth_token"; echo "down" ;;
  *) sed -n '2,22p' "$0" >&2; exit 2 ;;
esac
