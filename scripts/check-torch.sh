#!/usr/bin/env bash
# torch releases against DTA's core families (default: every minor release of pyproject's
# range): a venv per release under /tmp/dta-torch (deleted after; each CUDA build is ~1 GB
# plus a few GB of NVIDIA libraries), the lock's other packages, dta verify in float64 and
# the core exactness tests. Prints a table version x family; docs/versions.md holds it.
#   bash scripts/check-torch.sh [VERSION ...] [--work DIR] [--keep] [--markdown FILE] [--json]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "check-torch.sh: no .venv (run scripts/setup.sh first)" >&2; exit 1; }
exec .venv/bin/python scripts/check_torch.py "$@"
