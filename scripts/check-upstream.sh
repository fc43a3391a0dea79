#!/usr/bin/env bash
# Upstream drift, found by us: each transformers release (default: every minor release of
# pyproject's range and the newest on the registry) against every family of DTA's support
# matrix and the hybrid tests, without touching .venv. Prints a table version x family.
#   bash scripts/check-upstream.sh [VERSION ...] [--markdown FILE] [--json]
# docs/versions.md says how its table is used.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "check-upstream.sh: no .venv (run scripts/setup.sh first)" >&2; exit 1; }
exec .venv/bin/python scripts/check_upstream.py "$@"
