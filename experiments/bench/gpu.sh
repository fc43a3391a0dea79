#!/usr/bin/env bash
# The GPU run (one H200; at most 10 minutes per command), three stages in one results folder:
#  1. checks (experiments/gpu_checks.py): the split attention through every kernel backend
#     against one masked SDPA call (bf16, float32), `dta verify` float32 exactness and bf16
#     fidelity against float64 on Qwen3-0.6B- and Qwen3.5-shaped random-init models, the
#     GDN kernel's self-check, and no dense mask over cached keys (CHECKS_S seconds at most);
#  2. the benchmark below;
#  3. the layouts (experiments/bench_layouts.py, LAYOUTS_S seconds at most): memory per
#     sharding layout on one rank (replicate, zero1, zero2, fsdp, fsdp + prefetch: the
#     device's peak and the state each holds) and fsdp's all-gathers with and without
#     prefetch in a torch.profiler trace of rank 0 of LAYOUTS_WORLD ranks sharing the GPU
#     (the fraction of all-gather time under compute; Chrome traces in layouts/);
#  4. the blocks memory run (experiments/bench_blocks.py, what the budget leaves, >= 30 s);
# then one JSON line (also gpu.json) with each stage's verdict and figures.
#
# The benchmark: a τ²-airline
# per-call batch in bf16 on Qwen3-0.6B- and Qwen3-1.7B-shaped random-init models, with sdpa,
# flex_attention (the DFS packs' tree masks as FlexAttention block masks) and, where flash-attn
# is installed, flash_attention_2 (packs with branches cannot take a mask there: only the
# unpacked baselines and dfs-node run with it). Per (size, attention) one
# `dta bench --in-process --warmup full` run (model loaded once, modes interleaved, CUDA peak
# memory per run); the whole script keeps inside BUDGET_S seconds: a configuration that
# cannot start with MIN_LEFT_S left is skipped, and a running one is stopped in time (its
# worker writes each finished run, so what finished is reported).
#
#   experiments/bench/gpu.sh [DEST]     DEST default: $TMPDIR/gpu-run when $OUT (the device
#                                       tool's folder) is set, packed into it at the end; else
#                                       results/gpu-<date>
# Knobs (environment): SIZES ATTNS MODES SCALE DTYPE DEVICE REPEATS BUDGET_S MIN_LEFT_S
#   PAD_BATCH MICROBATCH_TOKENS TREE_TOKENS PACK_TOKENS PYTHON; CHECK_SIZE CHECK_FAMILIES
#   CHECKS_S; LAYOUTS_S (reserved; 0: no layouts run) LAYOUTS_SIZE LAYOUTS_SCALE LAYOUTS_WORLD;
#   BLOCKS (the block settings) BLOCKS_SIZE BLOCKS_SCALE BLOCKS_S (reserved; 0: no
#   blocks run); WHEELS (default .whl): wheels installed into /tmp/dta-site first, put ahead
#   on PYTHONPATH -- for a machine that cannot reach the registry, made here by
#   experiments/bench/gpu-wheels.sh (docs/gpu.md: running it on a lent GPU machine).
# CPU check of this script (what tests/test_bench_gpu_script.py runs):
#   DEVICE=cpu SIZES=tiny SCALE=tiny DTYPE=float32 REPEATS=1 CHECK_FAMILIES=qwen3 \
#     BLOCKS="0 4096" BLOCKS_SIZE=tiny BLOCKS_SCALE=0.05 LAYOUTS_SCALE=tiny \
#     experiments/bench/gpu.sh /tmp/g
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# under the device tool (OUT set, at most 8 files come back): the folder is written beside
# and handed back as $OUT/gpu-results.tar.gz with gpu.json and summary.md
DEST=${1:-${OUT:+${TMPDIR:-/tmp}/gpu-run}}
DEST=${DEST:-results/gpu-$(date +%Y%m%d-%H%M%S)}
PY=${PYTHON:-$(command -v python || command -v python3)}
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    echo "== installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into /tmp/dta-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/dta-site "$WHEELS"/*.whl \
        || { echo "gpu.sh: installing the wheels in $WHEELS failed (see above)" >&2; exit 2; }
    export PYTHONPATH=/tmp/dta-site${PYTHONPATH:+:$PYTHONPATH}
fi
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
SIZES=${SIZES:-"qwen3-0.6b qwen3-1.7b"}
SCALE=${SCALE:-0.15}            # airline per-call: ~107 sequences, ~151K tokens, sharing ~9.4x
REPEATS=${REPEATS:-2}
BUDGET_S=${BUDGET_S:-560}       # the device tool kills a command at 600 s
MIN_LEFT_S=${MIN_LEFT_S:-75}
PAD_BATCH=${PAD_BATCH:-8}       # padded mode: [8, S_max] batches
MICROBATCH_TOKENS=${MICROBATCH_TOKENS:-16384}
TREE_TOKENS=${TREE_TOKENS:-32768}
PACK_TOKENS=${PACK_TOKENS:-2048}  # a GPU pays more per call: bigger packs
if [ "$DEVICE" = cpu ]; then CHECK_SIZE=${CHECK_SIZE:-tiny}; else CHECK_SIZE=${CHECK_SIZE:-qwen3-0.6b}; fi
CHECK_FAMILIES=${CHECK_FAMILIES:-qwen3,qwen3_5}
CHECKS_S=${CHECKS_S:-150}
BLOCKS=${BLOCKS:-"0 2048 1024"}
BLOCKS_SIZE=${BLOCKS_SIZE:-small}
BLOCKS_SCALE=${BLOCKS_SCALE:-1}
BLOCKS_S=${BLOCKS_S:-100}
if [ "$DEVICE" = cpu ]; then LAYOUTS_SIZE=${LAYOUTS_SIZE:-tiny}; else LAYOUTS_SIZE=${LAYOUTS_SIZE:-qwen3-0.6b}; fi
LAYOUTS_SCALE=${LAYOUTS_SCALE:-0.05}
LAYOUTS_WORLD=${LAYOUTS_WORLD:-2}
LAYOUTS_S=${LAYOUTS_S:-150}
mkdir -p "$DEST"
start=$(date +%s)

"$PY" - "$DEVICE" > "$DEST/env.json" <<'EOF'
import json, sys, torch, transformers
info = dict(torch=torch.__version__, transformers=transformers.__version__,
            cuda=torch.version.cuda, device=sys.argv[1])
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
try:
    import flash_attn
    info["flash_attn"] = flash_attn.__version__
except ImportError:
    info["flash_attn"] = None
print(json.dumps(info))
EOF
cat "$DEST/env.json"

echo "== checks ($CHECK_SIZE: $CHECK_FAMILIES)"
timeout --kill-after=10 "$CHECKS_S" "$PY" -m experiments.gpu_checks --device "$DEVICE" \
    --size "$CHECK_SIZE" --families "$CHECK_FAMILIES" --out "$DEST/checks" --json \
    > "$DEST/checks.log" 2>&1
checks_rc=$?
tail -n 1 "$DEST/checks.log" > "$DEST/checks.json"
grep -E '^(attention|PASS|FAIL|qwen)' "$DEST/checks.log" | sed 's/^/   /'
echo "   checks rc=$checks_rc"
BENCH_END=$(( BUDGET_S - BLOCKS_S - LAYOUTS_S ))  # the benchmark leaves the later stages their time

if [ -z "${ATTNS:-}" ]; then
    ATTNS=sdpa
    [ "$DEVICE" != cpu ] && ATTNS="sdpa flex_attention"
    if [ "$DEVICE" != cpu ] && "$PY" -c "import flash_attn" 2>/dev/null; then
        ATTNS="$ATTNS flash_attention_2"
    fi
fi
if [ -z "${MODES:-}" ]; then
    MODES=padded,microbatch,treemask,dfs-node,dfs-retain,dfs-recompute
    [ "$DEVICE" != cpu ] && MODES=padded,microbatch,treemask,treemask-flex,dfs-node,dfs-retain,dfs-recompute
fi

status=0
for attn in $ATTNS; do
    for size in $SIZES; do
        left=$(( BENCH_END - ($(date +%s) - start) ))
        name="$size-$attn"
        if [ "$left" -lt "$MIN_LEFT_S" ]; then
            echo "skip $name: ${left}s left" | tee -a "$DEST/skipped.txt"
            continue
        fi
        modes=$MODES
        # tree-mask modes run sdpa / flex whatever --attn says: measure them once, with sdpa;
        # flex: the packed DFS modes only; flash-attn takes no tree mask: no packed DFS modes
        [ "$attn" != sdpa ] && modes=$(echo "$MODES" | tr , '\n' | grep -v '^treemask' | paste -sd,)
        [ "$attn" = flex_attention ] && modes=$(echo "$modes" | tr , '\n' | grep -E '^(microbatch|dfs-retain|dfs-recompute)$' | paste -sd,)
        [ "$attn" = flash_attention_2 ] && modes=$(echo "$modes" | tr , '\n' | grep -vE '^dfs-(retain|recompute)$' | paste -sd,)
        echo "== $name (${left}s left): $modes"
        timeout --kill-after=10 "$left" "$PY" -m dta_cli.main bench --device "$DEVICE" \
            --dtype "$DTYPE" --model-size "$size" --attn "$attn" --scale "$SCALE" \
            --modes "$modes" --repeats "$REPEATS" --in-process --warmup full \
            --pad-batch "$PAD_BATCH" --microbatch-tokens "$MICROBATCH_TOKENS" \
            --tree-tokens "$TREE_TOKENS" --pack-tokens "$PACK_TOKENS" --timeout $(( left - 15 )) --out "$DEST/$name" \
            --json > "$DEST/$name.log" 2>&1
        rc=$?
        tail -n 1 "$DEST/$name.log" > "$DEST/$name.json"
        echo "   rc=$rc; $(head -c 300 "$DEST/$name.json")"
        [ "$rc" -gt 1 ] && status=$rc   # 1: a mode WRONG or FAILED (reported in the table)
    done
done

layouts_rc=skipped
left=$(( BUDGET_S - BLOCKS_S - ($(date +%s) - start) ))
[ "$left" -gt "$LAYOUTS_S" ] && left=$LAYOUTS_S  # the blocks run keeps what the rest left
if [ "$LAYOUTS_S" -gt 0 ] && [ "$left" -ge 30 ]; then
    echo "== layouts (${left}s left): $LAYOUTS_SIZE, overlap on $LAYOUTS_WORLD ranks"
    timeout --kill-after=10 "$left" "$PY" -m experiments.bench_layouts --device "$DEVICE" \
        --size "$LAYOUTS_SIZE" --scale "$LAYOUTS_SCALE" --dtype "$DTYPE" \
        --world "$LAYOUTS_WORLD" --out "$DEST/layouts" --json > "$DEST/layouts.log" 2>&1
    layouts_rc=$?
    tail -n 1 "$DEST/layouts.log" > "$DEST/layouts.json"
    grep -E '^(  [a-z]|fsdp)' "$DEST/layouts.log" | sed 's/^/   /'
    echo "   layouts rc=$layouts_rc"
else
    echo "skip layouts: ${left}s left" | tee -a "$DEST/skipped.txt"
fi

blocks_rc=skipped
left=$(( BUDGET_S - ($(date +%s) - start) ))
if [ "$BLOCKS_S" -gt 0 ] && [ "$left" -ge 30 ]; then
    echo "== blocks (${left}s left): $BLOCKS"
    # shellcheck disable=SC2086
    timeout --kill-after=10 "$left" "$PY" -m experiments.bench_blocks --device "$DEVICE" \
        --blocks $BLOCKS --size "$BLOCKS_SIZE" --scale "$BLOCKS_SCALE" --repeats 1 --out "$DEST/blocks" --json \
        > "$DEST/blocks.log" 2>&1
    blocks_rc=$?
    tail -n 1 "$DEST/blocks.log" > "$DEST/blocks.json"
    echo "   blocks rc=$blocks_rc"
else
    echo "skip blocks: ${left}s left" | tee -a "$DEST/skipped.txt"
fi

{
    echo "# GPU run ($(date -u +%Y-%m-%dT%H:%MZ)), $(cat "$DEST/env.json")"
    echo
    echo '## checks'
    echo '```'
    grep -E '^(attention|PASS|FAIL|qwen)' "$DEST/checks.log"
    echo '```'
    for f in "$DEST"/*/results.md; do [ -f "$f" ] && { echo; cat "$f"; }; done
    echo
    echo '## layouts'
    echo '```'
    grep -E '^(memory|  [a-z]|fsdp)' "$DEST/layouts.log" 2>/dev/null
    echo '```'
} > "$DEST/summary.md"
"$PY" -m experiments.gpu_summary "$DEST" "$checks_rc" "$blocks_rc" \
    "$(( $(date +%s) - start ))" "$layouts_rc" > "$DEST/gpu.json"
echo "done in $(( $(date +%s) - start ))s: $DEST/summary.md"
if [ -n "${OUT:-}" ] && [ "$DEST" != "$OUT" ]; then
    tar czf "$OUT/gpu-results.tar.gz" -C "$(dirname "$DEST")" "$(basename "$DEST")"
    cp "$DEST/gpu.json" "$DEST/summary.md" "$OUT/"
fi
cat "$DEST/gpu.json"
[ "$checks_rc" -ne 0 ] && status=$checks_rc
exit $status
