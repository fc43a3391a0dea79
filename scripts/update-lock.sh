#!/usr/bin/env bash
# Write constraints.txt, the tested dependency set, from the .venv that just passed the suite:
#   bash scripts/setup.sh --areal --verl && .venv/bin/python -m pytest && bash scripts/update-lock.sh
# scripts/setup.sh (and so CI) installs through it, so a fresh machine gets exactly what CI
# tested. torch is written without its local label (+cpu): `pip install torch==2.13.0` takes
# the local CPU wheel. docs/versions.md says when to re-lock.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "update-lock.sh: no .venv (run scripts/setup.sh first)" >&2; exit 1; }
{
  echo "# The dependency set CI tested (scripts/update-lock.sh wrote it from a passing .venv,"
  echo "# $(date -u +%Y-%m-%d), Python $(.venv/bin/python -c 'import platform; print(platform.python_version())')). scripts/setup.sh installs through it: pip -c constraints.txt."
  .venv/bin/python -m pip freeze --exclude-editable --disable-pip-version-check 2>/dev/null \
    | grep -v '^-e ' | sed -E 's/^(torch==[0-9.]+)\+[a-z0-9.]+$/\1/' | LC_ALL=C sort -f
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
echo "update-lock.sh: $(grep -vc '^#' constraints.txt) packages pinned in constraints.txt"
