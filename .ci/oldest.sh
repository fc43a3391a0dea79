#!/usr/bin/env bash
# CI's second part: the oldest supported pair -- pyproject's floors, torch 2.9.1 and
# transformers 5.0.0, both inside AReaL 1.0.4's own pins (torch >=2.9.1,<2.11; transformers
# >=5.0.0,<=5.3.0) -- in a venv of its own (.venv-oldest), running the core exactness tests
# and the doors' tests (the engine core behind every front door, AReaL's engine). The lock's
# suite (.ci/run's first line, the README's command) stays the default tested set; this adds
# the floor. torch 2.9.1 is the registry's CUDA build (it runs on a CPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
floor() { sed -n "s/^ *\"$1>=\([0-9.]*\),<=.*/\1/p" pyproject.toml; }
TORCH=$(floor torch)
TRANSFORMERS=$(floor transformers)
[ -n "$TORCH" ] && [ -n "$TRANSFORMERS" ] || { echo "oldest.sh: no floors in pyproject.toml" >&2; exit 1; }
echo "oldest.sh: torch $TORCH, transformers $TRANSFORMERS in .venv-oldest"
start=$(date +%s)
PY=${PYTHON:-python3}
[ -x .venv-oldest/bin/python ] || "$PY" -m venv .venv-oldest
# shellcheck disable=SC1091
. .venv-oldest/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# the lock without what the floor's transformers pins its own way (tokenizers, the hub)
LOCK=$PWD/.venv-oldest/lock-at-the-floor.txt
grep -viE '^(torch|torchdata|torchvision|transformers|tokenizers|huggingface.hub|hf.xet|kernels.*)==' \
  constraints.txt > "$LOCK"
python -m pip install -q --no-cache-dir "torch==$TORCH"
python -m pip install -q -c "$LOCK" "transformers==$TRANSFORMERS" -e ".[ray,dev,lora]"
if ! python -c "import areal" 2>/dev/null; then
  DTA_TORCH_VERSION=$TORCH DTA_LOCK=$LOCK bash .ci/install-areal.sh
fi
python -c "import torch, transformers; print(f'oldest.sh: installed torch {torch.__version__}, transformers {transformers.__version__}')"
echo "oldest.sh: set up in $(( $(date +%s) - start )) s"
python -m pytest -p no:cacheprovider tests/test_equivalence.py tests/test_engine_front_doors.py \
  tests/test_areal_engine.py
echo "oldest.sh: done in $(( $(date +%s) - start )) s"
