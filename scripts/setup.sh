#!/usr/bin/env bash
# Set up .venv for DTA on a fresh machine: torch 2.13.0 (the local CPU wheel; an unpinned
# torch would pull a multi-GB CUDA build), this package with its ray, dev and lora extras, and with
# --areal the optional AReaL 1.0.4 backend (see runtime/areal/README.md), with --verl the
# optional verl 0.9.1 engine (docs/verl.md).
# Every package is installed at the version CI tested: constraints.txt, the lock
# (scripts/update-lock.sh writes it; docs/versions.md).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_AREAL=0
WITH_VERL=0
for arg in "$@"; do
  case "$arg" in
    --areal) WITH_AREAL=1 ;;
    --verl) WITH_VERL=1 ;;
    *) echo "usage: scripts/setup.sh [--areal] [--verl]" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
export DTA_LOCK="$PWD/constraints.txt"  # the tested set; .ci/install-lib.sh installs through it too
[ -f "$DTA_LOCK" ] || { echo "setup.sh: $DTA_LOCK is missing" >&2; exit 1; }
python -m pip install -q -c "$DTA_LOCK" torch==2.13.0
python -m pip install -q -c "$DTA_LOCK" -e ".[ray,dev,lora]"
if [ "$WITH_AREAL" = 1 ]; then
  if python -c "import areal" 2>/dev/null; then
    echo "setup.sh: areal already installed"
  else
    bash .ci/install-areal.sh
  fi
fi
if [ "$WITH_VERL" = 1 ]; then bash .ci/install-verl.sh; fi  # the verl engine (docs/verl.md)
python -c "import torch, transformers, dta; print(f'setup.sh: torch {torch.__version__}, transformers {transformers.__version__}, dta ready in .venv')"
