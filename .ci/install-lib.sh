# Shared by .ci/install-areal.sh and .ci/install-verl.sh (sourced, not run): install a package
# with --no-deps into the ACTIVE virtual environment beside torch 2.13.0 (the local CPU wheel)
# and the dta package, adding only the dependencies its caller lists, resolved against the
# installed torch, transformers and numpy, and to the tested set (constraints.txt, the lock that
# scripts/setup.sh passes as DTA_LOCK). Fails loudly: any failed step, a torch other than
# 2.13.0 before or after, ends the caller non-zero.
# The caller sets NAME (for messages) before sourcing.
set -euo pipefail

TORCH_VERSION=${DTA_TORCH_VERSION:-2.13.0}  # .ci/oldest.sh: the oldest supported torch
die() { echo "$NAME: ERROR: $*" >&2; exit 1; }
log() { echo "$NAME: $*"; }

PY=${PYTHON:-python}
command -v "$PY" >/dev/null || die "no '$PY' on PATH"
"$PY" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' \
  || die "no active virtual environment ($PY is $(command -v "$PY")); activate one first"

torch_is_pinned() {
  "$PY" -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$TORCH_VERSION' else 1)"
}
torch_is_pinned || die "torch==$TORCH_VERSION must already be installed (pip install torch==$TORCH_VERSION)"
"$PY" -c 'import dta' || die "the dta package must already be installed (pip install -e .)"

# Everything installed is resolved against these constraints: torch stays the local CPU
# wheel, and the libraries dta already uses keep their installed versions.
CONSTRAINTS=$(mktemp "${TMPDIR:-/tmp}/$NAME-constraints.XXXXXX")
trap 'rm -f "$CONSTRAINTS"' EXIT
"$PY" - "$CONSTRAINTS" "$TORCH_VERSION" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
pins = {"torch": sys.argv[2]}
for name in ("transformers", "numpy", "tokenizers", "safetensors", "huggingface-hub"):
    try:
        pins[name] = version(name)
    except PackageNotFoundError:
        pass
with open(sys.argv[1], "w") as f:
    f.writelines(f"{k}=={v}\n" for k, v in pins.items())
PYEOF
log "constraints: $(tr '\n' ' ' < "$CONSTRAINTS")"
LOCK=${DTA_LOCK:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/constraints.txt}
[ -f "$LOCK" ] || die "the tested set $LOCK is missing"
log "tested set: $LOCK"

# install_no_deps PACKAGE==VERSION DEP...: the dependencies (constrained), then the package
# itself with --no-deps; torch must be unchanged afterwards
install_no_deps() {
  local package=$1; shift
  log "installing $# dependencies"
  "$PY" -m pip install -q -c "$CONSTRAINTS" -c "$LOCK" "$@"
  log "installing $package --no-deps"
  "$PY" -m pip install -q --no-deps "$package"
  torch_is_pinned || die "torch changed during the install (now $("$PY" -c 'import torch; print(torch.__version__)'))"
}
