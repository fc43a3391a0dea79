#!/usr/bin/env bash
# DTA inside its hosts' own environments (AReaL 1.0.4, verl 0.9.1, SGLang 0.5.23, vLLM 0.33.0):
# a fresh venv per host under --venvs (default /work/venvs/host-NAME, outside the checkout), the
# host installed with its dependencies as its users do, its versions frozen, DTA installed from
# this checkout without moving one of them, then dta train, dta verify --dtype float64 on every
# family, and the AReaL / verl door's tests there. Prints a table host x check.
#   bash scripts/check-hosts.sh [areal|verl|sglang|vllm ...] [--venvs DIR] [--keep] [--reuse]
#                               [--skip PKG] [--markdown FILE] [--json]
# Needs only a Python 3.10+ with venv; each host's venv takes 5-15 GB while it is checked.
# docs/versions.md ("In the hosts' environments") has its table.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "check-hosts.sh: no $PY on PATH" >&2; exit 1; }
exec "$PY" scripts/check_hosts.py "$@"
