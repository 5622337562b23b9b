#!/usr/bin/env bash
# Start or stop this machine's Ray node for ExpertSweep sweeps.
#
#   bash infra/start_host.sh head   [--name NAME] [--gpus N] [--cpus N] [--model M]... [--port 6379] [--dashboard-host 127.0.0.1]
#   bash infra/start_host.sh worker --address HEAD_IP:6379 [--name NAME] [--gpus N] [--cpus N] [--model M]...
#   bash infra/start_host.sh stop
#
# Every host is a Ray node with the custom resource host:NAME = 1 (trials of host NAME run only
# there) and its GPU count. NAME and the counts come from the flags, else from
# ~/.expertsweep/host.env (EXPERTSWEEP_HOST=rtx4090, EXPERTSWEEP_GPUS=1, EXPERTSWEEP_CPUS=8),
# else the host name and what Ray detects. A node that holds a checkpoint also offers
# model:M = 1 per --model M (or EXPERTSWEEP_MODELS="M1 M2"): a sweep with `model_resource: M`
# records and emulates that model there (docs/sweep.md, "Your checkpoint in a sweep").
# The node runs as `ray start --block` in the background; its pid is kept in
# ~/.expertsweep/ray.pid and `stop` ends it by that pid.
# Run from the repository's virtual environment (the workers import the project from it).
# Safe by default on a network: Ray's token authentication on (RAY_AUTH_MODE=token; a head without a
# token generates ~/.ray/auth_token) and the dashboard / job API on 127.0.0.1 (--dashboard-host or
# EXPERTSWEEP_DASHBOARD_HOST to open it, e.g. to the cluster network's own address).
set -euo pipefail
state="${EXPERTSWEEP_STATE:-$HOME/.expertsweep}"
mkdir -p "$state"
[ -f "$state/host.env" ] && . "$state/host.env"
role="${1:-}"; shift || true
name="${EXPERTSWEEP_HOST:-$(hostname -s)}"; gpus="${EXPERTSWEEP_GPUS:-}"; cpus="${EXPERTSWEEP_CPUS:-}"
port=6379; address=""; dashboard_host="${EXPERTSWEEP_DASHBOARD_HOST:-127.0.0.1}"
read -r -a models <<< "${EXPERTSWEEP_MODELS:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dashboard-host) dashboard_host="$2"; shift 2 ;;
    --name) name="$2"; shift 2 ;;
    --gpus) gpus="$2"; shift 2 ;;
    --cpus) cpus="$2"; shift 2 ;;
    --model) models+=("$2"); shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --address) address="$2"; shift 2 ;;
    *) echo "start_host.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
here="$(cd "$(dirname "$0")/.." && pwd)"
ray="$here/.venv/bin/ray"; [ -x "$ray" ] || ray="$(command -v ray)"
# jobs run `python ...` with the node's PATH: make it the environment the node runs in
export PATH="$(dirname "$ray"):$PATH"
# Token authentication is on by default (RAY_AUTH_MODE=token): the head needs a token (RAY_AUTH_TOKEN,
# RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; `head` creates ~/.ray/auth_token with
# `ray get-auth-token --generate` when there is none), every worker and every client (ray job submit,
# the driver) the same one. RAY_AUTH_MODE=disabled turns it off, for a network nobody else reaches.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
has_token() { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; }
resources="\"host:$name\": 1"
for m in "${models[@]}"; do
  case "$m" in *[!A-Za-z0-9._-]*|"") echo "start_host.sh: --model $m: use letters, digits, ., - and _" >&2; exit 2 ;; esac
  resources+=", \"model:$m\": 1"
done
common=(--block --resources "{$resources}" --disable-usage-stats)
[ -n "$gpus" ] && common+=(--num-gpus "$gpus")
[ -n "$cpus" ] && common+=(--num-cpus "$cpus")
case "$role" in
  head)
    if [ "$RAY_AUTH_MODE" = token ] && ! has_token; then
      "$ray" get-auth-token --generate > /dev/null
      chmod 600 "$HOME/.ray/auth_token"
      echo "generated a Ray auth token in ~/.ray/auth_token: copy it to every worker and client (mode 600)"
    fi
    # the dashboard and job API (8265) on this machine only, unless --dashboard-host says otherwise
    args=(--head --port "$port" --dashboard-host "$dashboard_host" "${common[@]}") ;;
  worker)
    [ -n "$address" ] || { echo "start_host.sh worker: --address HEAD_IP:PORT is required" >&2; exit 2; }
    if [ "$RAY_AUTH_MODE" = token ] && ! has_token; then
      echo "start_host.sh worker: RAY_AUTH_MODE=token and no token: copy the head's ~/.ray/auth_token here (or set RAY_AUTH_TOKEN)" >&2; exit 2
    fi
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
  *) sed -n '2,19p' "$0" >&2; exit 2 ;;
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
echo "Ray $role node for host:$name${models:+ (model:${models[*]})} up (pid $(cat "$state/ray.pid"), log $state/ray-node.log)"
