#!/usr/bin/env bash
# Install AReaL 1.0.4 for CPU into the ACTIVE virtual environment, without its CUDA tree.
#
# Precondition: the venv already has torch==2.13.0 (the local CPU wheel) and the dta package
# (`pip install torch==2.13.0 && pip install -e .`). `pip install areal==1.0.4` would resolve
# torch 2.10 + CUDA (~9.4 GB), so areal goes in with --no-deps and this script adds only what
# `import areal...` needs for TrainEngine, FSDPEngine, PPOActor and grpo_loss_fn.
#
# Idempotent (pinned versions; a second run is a no-op apart from pip's checks). Fails loudly:
# any failed step, a torch other than 2.13.0, or a failing import ends the script non-zero.
# See docs/areal-notes.md for how this list was found and what was measured.
set -euo pipefail
NAME=install-areal.sh
AREAL_VERSION=1.0.4
source "$(dirname "$0")/install-lib.sh"

# What `import areal.engine.fsdp_engine` / `areal.trainer.ppo.actor` needs on CPU
# (found by installing one missing import at a time; versions as tested with areal 1.0.4).
# ray gets its [default] extra so that dta's own Ray runtime (`dta submit`, the job API) works.
# hydra-core 1.4.0.dev1 is what areal pins (1.3.x requires omegaconf < 2.4); omegaconf 2.4.0
# satisfies its omegaconf>=2.4.0.dev2 (areal pins ==2.4.0.dev2, not needed).
DEPS=(
  "hydra-core==1.4.0.dev1" "omegaconf>=2.4.0.dev2,<2.5"
  "aiohttp==3.14.5" "aiofiles==25.1.0" "httpx==0.28.1" "flask==3.1.3" "uvloop==0.23.0"
  "colorlog==6.12.0" "tenacity==9.2.1" "lark==1.3.1" "pyyaml==6.0.4" "tabulate==0.10.0"
  "orjson==3.13.0" "pybase64==1.5.1" "einops==0.8.2" "pillow==12.3.0"
  "torchdata==0.11.0" "ray[default]==2.60.0" "numba==0.68.1" "openai==3.57.0" "peft==0.21.2"
  "datasets==5.2.0" "swanlab==0.10.3" "trackio==0.43.0" "wandb==0.31.0" "tensorboardX==2.6.5"
)
install_no_deps "areal==$AREAL_VERSION" "${DEPS[@]}"
log "checking imports"
"$PY" - <<'EOF' || die "areal imports failed"
import importlib.metadata as md
from areal.api.engine_api import TrainEngine
from areal.engine.fsdp_engine import FSDPEngine
from areal.trainer.ppo.actor import PPOActor, grpo_loss_fn
from areal.utils.functional import ppo_actor_loss_fn
import dta
assert len(TrainEngine.__abstractmethods__) == 30, sorted(TrainEngine.__abstractmethods__)
print("install-areal.sh: OK areal", md.version("areal"), "torch", md.version("torch"),
      "transformers", md.version("transformers"), "omegaconf", md.version("omegaconf"))
EOF
