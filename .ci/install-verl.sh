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

VERL_VERSION=0.9.1
TORCH_VERSION=2.13.0

die() { echo "install-verl.sh: ERROR: $*" >&2; exit 1; }
log() { echo "install-verl.sh: $*"; }

PY=${PYTHON:-python}
command -v "$PY" >/dev/null || die "no '$PY' on PATH"
"$PY" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' \
  || die "no active virtual environment ($PY is $(command -v "$PY")); activate one first"
"$PY" -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$TORCH_VERSION' else 1)" \
  || die "torch==$TORCH_VERSION must already be installed (pip install torch==$TORCH_VERSION)"
"$PY" -c 'import dta' || die "the dta package must already be installed (pip install -e .)"

# torch stays the local CPU wheel; the libraries dta already uses keep their versions
CONSTRAINTS=$(mktemp "${TMPDIR:-/tmp}/verl-constraints.XXXXXX")
trap 'rm -f "$CONSTRAINTS"' EXIT
"$PY" - "$CONSTRAINTS" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
pins = {"torch": "2.13.0"}
for name in ("transformers", "numpy", "tokenizers", "safetensors", "huggingface-hub"):
    try:
        pins[name] = version(name)
    except PackageNotFoundError:
        pass
with open(sys.argv[1], "w") as f:
    f.writelines(f"{k}=={v}\n" for k, v in pins.items())
PYEOF
log "constraints: $(tr '\n' ' ' < "$CONSTRAINTS")"

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
log "installing ${#DEPS[@]} dependencies"
"$PY" -m pip install -q -c "$CONSTRAINTS" "${DEPS[@]}"
log "installing verl==$VERL_VERSION --no-deps"
"$PY" -m pip install -q --no-deps "verl==$VERL_VERSION"

"$PY" -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$TORCH_VERSION' else 1)" \
  || die "torch changed during the install (now $("$PY" -c 'import torch; print(torch.__version__)'))"
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
