#!/usr/bin/env bash
# Install verl 0.9.1 for CPU into the ACTIVE virtual environment, beside torch 2.13.0 and the
# project's transformers.
#
# Precondition: the venv already has torch==2.13.0 (the local CPU wheel) and the dta package
# (`pip install torch==2.13.0 && pip install -e .`). verl 0.9.1 pins transformers<5.11 (the
# project runs 5.24) and its cpu/fsdp extras pin torch==2.11.0, so verl goes in with --no-deps
# and this script adds only what `import verl.workers.engine`, verl's FSDP engine, its losses,
# its workers and `verl.trainer.main_ppo` need, resolved against the installed torch,
# transformers and numpy.
# tests/test_verl*.py check verl's own FSDP engine against the dta engine on this install.
#
# Idempotent (pinned versions). Fails loudly: any failed step, a torch other than 2.13.0, or a
# failing import ends the script non-zero. See docs/verl.md.
set -euo pipefail
NAME=install-verl.sh
VERL_VERSION=0.9.1
source "$(dirname "$0")/install-lib.sh"

# verl's requirements that its engine, losses and trainer import (versions as tested);
# tensordict <= 0.10.0 is verl's own pin (it brings pyvers < 0.2, cloudpickle, orjson).
# hydra-core 1.4.0.dev1 / omegaconf 2.4 as AReaL's install has them (hydra 1.3 needs
# omegaconf < 2.4).
DEPS=(
  "tensordict==0.10.0" "codetiming==1.4.0"
  "pylatexenc==2.11" "hydra-core==1.4.0.dev1" "omegaconf>=2.4.0.dev2,<2.5"
  "accelerate==1.16.0" "datasets==5.2.0" "dill==0.4.1" "pandas==3.1.1" "pyarrow==26.0.1"
  "peft==0.21.2" "torchdata==0.11.0" "ray[default]==2.60.0" "wandb==0.31.0"
  "fastapi==0.165.0" "uvicorn==0.55.0"
)
install_no_deps "verl==$VERL_VERSION" "${DEPS[@]}"
log "checking imports"
"$PY" - <<'PYEOF' || die "verl imports failed"
import importlib.metadata as md
import warnings
warnings.simplefilter("ignore")
from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.losses import ppo_loss
import verl.trainer.main_ppo
import verl.workers.engine_workers  # verl's TrainingWorker (needs fastapi)
import runtime.verl
if "dta" not in EngineRegistry._engines["language_model"]:
    raise SystemExit("the dta engine is not registered")
print("install-verl.sh: OK verl", md.version("verl"), "torch", md.version("torch"),
      "transformers", md.version("transformers"), "tensordict", md.version("tensordict"))
PYEOF
