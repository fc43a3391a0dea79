# syntax=docker/dockerfile:1
# DTA on GPUs: CUDA, Python 3.11, torch (CUDA build), flash-attn, ray[default], and this package
# (`pip install .[ray,gpu]`, plus the AReaL backend's runtime/ package). Entrypoint: `dta`.
#
#   docker build -t dta .                                         # defaults below
#   docker build -t dta --build-arg MAX_JOBS=16 --build-arg FLASH_ATTN_CUDA_ARCHS="90" .
#   docker run --gpus all --shm-size=8g dta train --config configs/gpu-qwen3-0.6b.yaml
#
# flash-attn is on PyPI as source only (its setup.py otherwise downloads a prebuilt wheel from
# outside PyPI), so the builder stage compiles it (FLASH_ATTENTION_FORCE_BUILD=TRUE) and the
# runtime stage installs the wheel. Compiling is the slow part of the build: flash-attn's own
# figure is 3-5 minutes on a 64-core machine with ninja; with MAX_JOBS=4 and two architectures
# expect an hour or more. Each nvcc job can take several GB of memory: raise MAX_JOBS only with
# the RAM for it, and list only the GPU architectures you run on (80 = A100, 90 = H100/H200).
#
# CUDA_VERSION must have the same major version as the CUDA that the torch wheel was built
# with (python -c "import torch; print(torch.version.cuda)"); the builder checks this and stops
# with a message before compiling anything.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=22.04

# ------------------------------------------------------------------ builder: flash-attn --
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS builder

ARG TORCH_VERSION=2.13.0
ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG MAX_JOBS=4
ARG FLASH_ATTN_CUDA_ARCHS="80;90"

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu 22.04 ships Python 3.11 (python3.11*) beside its default 3.10.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential ca-certificates git python3.11 python3.11-dev python3.11-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv

RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir "ninja==1.13.2" "packaging==26.3" "psutil==7.2.2" \
        "setuptools==80.9.0" "wheel==0.48.0" \
    && python - <<'EOF'
import re, subprocess, torch
nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout
image = re.search(r"release (\d+)\.(\d+)", nvcc).groups()
wheel = (torch.version.cuda or "none").split(".")
if torch.version.cuda is None or image[0] != wheel[0]:
    raise SystemExit(f"torch {torch.__version__} was built with CUDA {torch.version.cuda}, the "
                     f"image has CUDA {'.'.join(image)}: set --build-arg CUDA_VERSION to a "
                     f"{wheel[0]}.x image (or another TORCH_VERSION)")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc {'.'.join(image)}: OK")
EOF

# --no-build-isolation: flash-attn compiles against the torch installed above.
RUN MAX_JOBS="${MAX_JOBS}" FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
    FLASH_ATTENTION_FORCE_BUILD=TRUE \
    pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /wheels \
        "flash-attn==${FLASH_ATTN_VERSION}"

# ------------------------------------------------------------------------ runtime image --
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}

ARG TORCH_VERSION=2.13.0
ARG RAY_VERSION=2.60.0

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3.11 python3.11-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv \
    && useradd --create-home --uid 1000 dta

# torch first and pinned by a constraints file, so that nothing below replaces it.
RUN echo "torch==${TORCH_VERSION}" > /opt/constraints.txt \
    && pip install --no-cache-dir -c /opt/constraints.txt "torch==${TORCH_VERSION}" \
        "ray[default]==${RAY_VERSION}"

COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir -c /opt/constraints.txt --no-deps /wheels/flash_attn-*.whl \
    && pip install --no-cache-dir -c /opt/constraints.txt "einops==0.8.2"

# The source tree stays at /opt/dta (configs/ included): `dta train --config configs/...`
WORKDIR /opt/dta
COPY --chown=1000:1000 . /opt/dta
# flash-attn (the gpu extra) and ray (the ray extra) are already there at the pinned versions.
RUN pip install --no-cache-dir -c /opt/constraints.txt ".[ray,gpu]" \
    && python -c "import dta, dta_cli, runtime, flash_attn, ray, torch; print('dta ready: torch', torch.__version__, 'flash-attn', flash_attn.__version__, 'ray', ray.__version__)"

# the user created above (uid 1000), by number so that the host can resolve it
USER 1000:1000
ENTRYPOINT ["dta"]
CMD ["--help"]
