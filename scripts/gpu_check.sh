#!/usr/bin/env bash
# The swap engine's checks on a CUDA machine, as one prepared run: tests/gpu, then
# `atomd bench swap` on three configurations. Everything lands in $OUT (or the
# folder given): nvidia-smi.txt, pytest-gpu.log, bench-*.json, bench-*.log.
#
# On the lent GPU machine (its python3 has CUDA torch but lacks a few of our dependencies):
#   here:  scripts/gpu_wheels.sh
#   there: run(command="scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# QUICK=1 runs a smoke version on any machine (tiny preset, device auto); ONLY="xl 2.7b-8GiB"
# runs only the benches named; TESTS=0 skips tests/gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/gpu-check}}
mkdir -p "$out"
# From a source tree without `pip install -e .`: the folders api/, bench/, migrations/ install
# as atomd_api, atomd_bench, atomd_migrations (pyproject's package-dir); links give them those
# names here.
names=$(mktemp -d)
for d in api bench migrations; do ln -sfn "$PWD/$d" "$names/atomd_$d"; done
export PYTHONUNBUFFERED=1 PYTHONPATH=".:$names${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
if ! $py -c "import pydantic, zstandard" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi 2>&1 | head -20
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

deadline=${DEADLINE:-500}  # seconds for the whole script: later benches shrink or are skipped
bench() {  # name, time limit (s), arguments of `atomd bench swap`
    local name=$1 limit=$2
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        return
    fi
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 30 ]; then
        echo "== bench $name skipped: $left s left of $deadline"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== bench $name (at most $limit s): $*"
    timeout "$limit" $py -m atomd bench swap --json "$@" >"$out/bench-$name.json" \
        2>"$out/bench-$name.log"
    echo "   exit $? after $SECONDS s in all"
    tail -c 600 "$out/bench-$name.json"
    echo
}

if [ "${QUICK:-0}" = 1 ]; then
    timeout 120 $py -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/pytest-gpu.log"
    bench tiny 120 --preset tiny --device auto --steps 2 --also-grad-clip 0
    bench tiny-device-opt 120 --preset tiny --device auto --steps 2 --swap-optimizer device
    bench tiny-recompute 120 --preset tiny --device auto --steps 2 --swap-graph-blocks 0 \
        --swap-micro-batches 2
    exit 0
fi
if [ "${TESTS:-1}" = 1 ]; then
    timeout 100 $py -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/pytest-gpu.log"
fi
xl=(--preset gpt3-xl --device cuda --micro-batch-size 4 --seq-len 2048 --grad-accum 4 --steps 3)
if [ "${DIAG:-0}" = 1 ]; then
    # Where the engine serializes: the reference script's own schedule (K=3, M=4,
    # every block recomputed) with the host AdamW, without then with clipping, both profiled;
    # ATOMD_SYNC_DEBUG makes torch warn at every device synchronization.
    ref=("${xl[@]}" --swap-optimizer host --swap-slots 3 --swap-micro-batches 4 --swap-graph-blocks 0)
    export ATOMD_SYNC_DEBUG=1
    bench xl-ref 150 "${ref[@]}" --grad-clip 0 --profile "$out/prof-xl-ref"
    bench xl-ref-clip 110 "${ref[@]}" --no-resident --profile "$out/prof-xl-ref-clip"
    exit 0
fi
# Every bench trains the spec's clipping (1.0) and then, on the same engine, without clipping
# (--also-grad-clip 0: the host AdamW then runs during the backward).
# gpt3-xl: 32k tokens per optimizer step, 4 micro-batches of 8k tokens (the ratio
# target): the planner's choice (the split optimizer over an fp32 link at the H200's rates,
# predicted 0.94 of resident with clipping), recorded and replayed at the measured rates; then
# the host optimizer alone with 14 of the 16 host threads (the worker ran 1.5x slower beside
# the issuing thread than alone), profiled.
bench xl 110 "${xl[@]}" --also-grad-clip 0 --trace "$out/trace-xl.json"
bench xl-host14 120 "${xl[@]}" --swap-optimizer host --host-threads 14 --also-grad-clip 0 \
    --profile "$out/prof-xl-host"
# Consumer-card budgets: 32k tokens per step as 16 micro-batches of 2k; references: resident
# training with every block recomputed (as the swapped run) and plain.
small=(--micro-batch-size 1 --seq-len 2048 --grad-accum 16 --steps 2 --device cuda)
bench 2.7b-8GiB 130 --preset gpt3-2.7b --gpu-mem 8GiB "${small[@]}" --also-grad-clip 0
bench 6.7b-12GiB 300 --preset gpt3-6.7b --gpu-mem 12GiB "${small[@]}" --also-grad-clip 0
