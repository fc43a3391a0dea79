#!/usr/bin/env bash
# Run HERE (a machine that reaches the package registry), before a GPU run on a machine that
# cannot: downloads into DEST (default .whl/, git-ignored) the wheels experiments/bench/gpu.sh
# needs beyond that machine's image (Python 3.12, x86-64; it has torch, triton, einops, numpy,
# safetensors, tokenizers, huggingface-hub, matplotlib, rich, tqdm, psutil): transformers and
# omegaconf at the versions this checkout's venv tests with, regex (transformers' floor), and
# flash-linear-attention (fla-core + flash-linear-attention: the GDN kernels). gpu.sh installs
# whatever DEST holds into /tmp/site first (WHEELS=DEST). flash-attn has no wheel on the
# registry (sdist only, a long CUDA build): the GPU run uses torch's own flash kernels.
#   experiments/bench/gpu-wheels.sh [DEST]          PYTHON: the venv to read versions from
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
FLA_VERSION=${FLA_VERSION:-0.6.0}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p "$DEST"
PKGS=("transformers==$(version transformers)" "omegaconf==$(version omegaconf)"
      "regex==$(version regex)" "fla-core==$FLA_VERSION" "flash-linear-attention==$FLA_VERSION")
echo "gpu-wheels.sh: ${PKGS[*]} -> $DEST"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do PLATFORMS+=(--platform "$p"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "${PKGS[@]}"
ls -1 "$DEST"
du -sh "$DEST"
