#!/usr/bin/env bash
# Submit one `kvtc recalibrate NAME ...` per UTC day to a Ray cluster, idempotently.
#
#   deploy/cron/kvtc-recalibrate.sh NAME [recalibrate options...]
#
# The submission id is kvtc-recalibrate-<name>-<YYYYMMDD>: Ray refuses a second job with the same id,
# so a cron entry that fires twice, or a host that runs it from two machines, starts one job a day.
# A job that failed keeps its id; resubmit that day with KVTC_ATTEMPT=2 (3, ...).
# Environment: RAY_ADDRESS (dashboard URL, default http://127.0.0.1:8265), KVTC_REGISTRY and the
# shard store URI (pass --store, shared by all runs: recalibration validates on the parent's held-out
# rows kept there), KVTC_WORKING_DIR (default: this checkout, uploaded with the job).
set -euo pipefail

name="${1:?usage: kvtc-recalibrate.sh NAME [recalibrate options...]}"
shift
address="${RAY_ADDRESS:-http://127.0.0.1:8265}"
safe_name="$(printf '%s' "$name" | tr -c 'A-Za-z0-9_.-' '-')"
id="kvtc-recalibrate-${safe_name}-$(date -u +%Y%m%d)"
if [ -n "${KVTC_ATTEMPT:-}" ]; then
  id="${id}-attempt${KVTC_ATTEMPT}"
fi
repo="${KVTC_WORKING_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"

if status="$(ray job status --address "$address" "$id" 2>/dev/null)"; then
  echo "kvtc-recalibrate: $id was already submitted today; not submitting again"
  echo "$status" | tail -n 1
  exit 0
fi

runtime_env="$(printf '{"working_dir": "%s", "env_vars": {"KVTC_REGISTRY": "%s", "HF_HUB_OFFLINE": "%s"}}' \
  "$repo" "${KVTC_REGISTRY:-}" "${HF_HUB_OFFLINE:-1}")"

# --no-wait: cron only submits; follow with `ray job logs --follow $id`.
# Exit codes of the job: 0 promoted or nothing to do, 5 published but kept unaliased (worse than its
# parent), 4 wrong model, 2 error.
exec ray job submit --address "$address" --submission-id "$id" --no-wait \
  --runtime-env-json "$runtime_env" \
  -- python -m kvtc.pipeline.cli recalibrate "$name" "$@"
