#!/usr/bin/env bash
# ExpertSweep's MLflow tracking server (or UI) on one store.
#
#   bash mlflow/start.sh          # tracking server: sweeps log with --mlflow-uri http://HOST:PORT
#   bash mlflow/start.sh ui       # the UI alone over the same store (make mlflow-ui)
#
# Configuration comes from the environment, else from mlflow/server.env (copy server.env.example),
# else the single-machine defaults below: the SQLite store the sweep writes by default and its
# artifact folder, served on 127.0.0.1:5000. For a shared server used by several hosts, point
# MLFLOW_BACKEND_STORE_URI at PostgreSQL and MLFLOW_ARTIFACTS_DESTINATION at a shared location
# (see docs/sweep.md, "Shared MLflow server").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
if [ -f "$here/server.env" ]; then
  set -a; . "$here/server.env"; set +a
fi
: "${MLFLOW_BACKEND_STORE_URI:=sqlite:///$here/mlflow.db}"
: "${MLFLOW_ARTIFACTS_DESTINATION:=$here/mlruns}"
: "${MLFLOW_HOST:=127.0.0.1}"
: "${MLFLOW_PORT:=5000}"
: "${MLFLOW_WORKERS:=1}"
export MLFLOW_DISABLE_TELEMETRY=true
mlflow="$repo/.venv/bin/mlflow"
[ -x "$mlflow" ] || mlflow="$(command -v mlflow)"
mode="${1:-server}"
# `ui` (make mlflow-ui): the runs page of the sweeps' experiment first, since MLflow 3.17's UI opens an
# experiment on its overview (a server starts at once: its clients find the runs themselves)
if [ "$mode" = ui ]; then
  ui_host="$MLFLOW_HOST"; [ "$ui_host" = "0.0.0.0" ] && ui_host="$(hostname)"
  py="$repo/.venv/bin/python"; [ -x "$py" ] || py="$(command -v python3)"
  runs_url="$(cd "$repo" && "$py" -c 'import sys
from sweep.tracking import experiment_id_of, runs_page
eid = experiment_id_of(sys.argv[1], sys.argv[3])
print(runs_page(sys.argv[2], eid) if eid else sys.argv[2] + "/#/experiments (no sweep logged yet)")' \
    "$MLFLOW_BACKEND_STORE_URI" "http://$ui_host:$MLFLOW_PORT" "${MLFLOW_EXPERIMENT:-expertsweep}" 2>/dev/null)" \
    || runs_url="http://$ui_host:$MLFLOW_PORT/"
  echo "MLflow UI on http://$ui_host:$MLFLOW_PORT; the sweeps' runs: $runs_url"
fi
case "$mode" in
  server)
    exec "$mlflow" server --backend-store-uri "$MLFLOW_BACKEND_STORE_URI" \
      --artifacts-destination "$MLFLOW_ARTIFACTS_DESTINATION" --serve-artifacts \
      --host "$MLFLOW_HOST" --port "$MLFLOW_PORT" --workers "$MLFLOW_WORKERS" ;;
  ui)
    exec "$mlflow" ui --backend-store-uri "$MLFLOW_BACKEND_STORE_URI" \
      --host "$MLFLOW_HOST" --port "$MLFLOW_PORT" ;;
  *)
    echo "usage: bash mlflow/start.sh [server|ui]" >&2; exit 2 ;;
esac
