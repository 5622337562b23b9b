#!/usr/bin/env bash
# Start or stop this machine's Ray node for ExpertSweep sweeps.
#
#   bash infra/start_host.sh head   [--name NAME] [--gpus N] [--cpus N] [--port 6379]
#   bash infra/start_host.sh worker --address HEAD_IP:6379 [--name NAME] [--gpus N] [--cpus N]
#   bash infra/start_host.sh stop
#
# Every host is a Ray node with the custom resource host:NAME = 1 (trials of host NAME run only
# there) and its GPU count. NAME and the counts come from the flags, else from
# ~/.expertsweep/host.env (EXPERTSWEEP_HOST=rtx4090, EXPERTSWEEP_GPUS=1, EXPERTSWEEP_CPUS=8),
# else the host name and what Ray detects. The node runs as `ray start --block` in the
# background; its pid is kept in ~/.expertsweep/ray.pid and `stop` ends it by that pid.
# Run from the repository's virtual environment (the workers import the project from it).
set -euo pipefail
state="${EXPERTSWEEP_STATE:-$HOME/.expertsweep}"
mkdir -p "$state"
[ -f "$state/host.env" ] && . "$state/host.env"
role="${1:-}"; shift || true
name="${EXPERTSWEEP_HOST:-$(hostname -s)}"; gpus="${EXPERTSWEEP_GPUS:-}"; cpus="${EXPERTSWEEP_CPUS:-}"
port=6379; address=""
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --gpus) gpus="$2"; shift 2 ;;
    --cpus) cpus="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --address) address="$2"; shift 2 ;;
    *) echo "start_host.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
here="$(cd "$(dirname "$0")/.." && pwd)"
ray="$here/.venv/bin/ray"; [ -x "$ray" ] || ray="$(command -v ray)"
# jobs run `python ...` with the node's PATH: make it the environment the node runs in
export PATH="$(dirname "$ray"):$PATH"
# Token authentication: set RAY_AUTH_MODE=token (and distribute ~/.ray/auth_token) on clusters
# reachable by others; the default here is explicit so that the first `ray start` does not decide.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
common=(--block --resources "{\"host:$name\": 1}" --disable-usage-stats)
[ -n "$gpus" ] && common+=(--num-gpus "$gpus")
[ -n "$cpus" ] && common+=(--num-cpus "$cpus")
case "$role" in
  head)
    args=(--head --port "$port" --dashboard-host "${EXPERTSWEEP_DASHBOARD_HOST:-0.0.0.0}" "${common[@]}") ;;
  worker)
    [ -n "$address" ] || { echo "start_host.sh worker: --address HEAD_IP:PORT is required" >&2; exit 2; }
    args=(--address "$address" "${common[@]}") ;;
  stop)
    if [ -f "$state/ray.pid" ] && kill -0 "$(cat "$state/ray.pid")" 2>/dev/null; then
      kill -TERM "$(cat "$state/ray.pid")"; echo "stopped Ray node (pid $(cat "$state/ray.pid"))"
      # a head leaves its address for `ray.init(address="auto")`; without `ray stop` nobody removes it
      cur="${RAY_TMPDIR:-/tmp/ray}/ray_current_cluster"
      if [ -f "$state/head.port" ] && [ -f "$cur" ] && grep -q ":$(cat "$state/head.port")\$" "$cur"; then rm -f "$cur"; fi
    else
      echo "no Ray node started by start_host.sh is running"
    fi
    rm -f "$state/ray.pid" "$state/head.port"; exit 0 ;;
  *) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
if [ -f "$state/ray.pid" ] && kill -0 "$(cat "$state/ray.pid")" 2>/dev/null; then
  echo "a Ray node is already running here (pid $(cat "$state/ray.pid")); stop it first" >&2; exit 1
fi
nohup "$ray" start "${args[@]}" > "$state/ray-node.log" 2>&1 &
echo $! > "$state/ray.pid"
[ "$role" = head ] && echo "$port" > "$state/head.port"
for _ in $(seq 120); do
  grep -q "Ray runtime started" "$state/ray-node.log" 2>/dev/null && break
  kill -0 "$(cat "$state/ray.pid")" 2>/dev/null || { tail -20 "$state/ray-node.log" >&2; exit 1; }
  sleep 0.5
done
echo "Ray $role node for host:$name up (pid $(cat "$state/ray.pid"), log $state/ray-node.log)"
