#!/usr/bin/env bash
# Issue 15 item 6: MiniLM-L6 on STS-B with sink + sliding-window softmax and a learned linear tail in every layer,
# against the softmax model fine-tuned with the same recipe, and the tail ablation (sinks + window only):
#
#   OUT=/tmp/stsb_window16 nice -n 10 bash benchmarks/scripts/stsb_window_hybrid.sh
#
# Rows (all through glue_recovery.sh, so one fine-tuning protocol: 3 epochs, batch 32, lr 1e-4, length 128, seed 42):
#   a  softmax MiniLM fine-tuned on STS-B (the baseline; also the teacher of e and the model converted in b)
#   e  (a) converted to band $WINDOW + $SINKS sink ([CLS]) exact softmax + a hedgehog tail (identity init, separate
#      query / key maps, gamma learned), attention transfer of the tail only (output MSE, teacher (a))
#   f  (e) fine-tuned with the arguments of (a)
#   b  (a) converted to the same band + sink with no linear tail (--no-linear-tail), no training
#   c  (b) fine-tuned with the arguments of (a)
# (e, f) and (b, c) run side by side after (a). Then collect_encoder_window.py writes $RESULT (+ .png).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python}"
OUT="${OUT:-/tmp/stsb_window16}"
WINDOW="${WINDOW:-16}"
SINKS="${SINKS:-1}"
VALIDATION_FILE="${VALIDATION_FILE:-$(dirname "$REPO")/shared/data/glue/STS-B/dev.tsv}"
RESULT="${RESULT:-$REPO/benchmarks/results/window_hybrid_stsb.json}"
export TASK=stsb OUT PYTHON
export FEATURE_MAP=hedgehog FEATURE_MAP_INIT=identity NB_FEATURES="${NB_FEATURES:-64}"
export TRANSFER_STEPS="${TRANSFER_STEPS:-256}" TRANSFER_SAMPLES="${TRANSFER_SAMPLES:-2048}"
HYBRID="--window $WINDOW --sinks $SINKS --softmax-weight learned --loss output"
WINDOW_ONLY="--window $WINDOW --sinks $SINKS --no-linear-tail"
RECOVERY="$REPO/benchmarks/scripts/glue_recovery.sh"

mkdir -p "$OUT"
RUNS="a" RESULT="$OUT/recovery_softmax.json" bash "$RECOVERY"
RUNS="e f" HYBRID_ARGS="$HYBRID" RESULT="$OUT/recovery_hybrid.json" bash "$RECOVERY" > "$OUT/hybrid.out" 2>&1 &
hybrid=$!
RUNS="b c" CONVERT_ARGS="$WINDOW_ONLY" RESULT="$OUT/recovery_window_only.json" bash "$RECOVERY" \
    > "$OUT/window_only.out" 2>&1 &
window_only=$!
status=0
wait "$hybrid" || { status=1; echo "hybrid rows failed: see $OUT/hybrid.out" >&2; }
wait "$window_only" || { status=1; echo "window-only rows failed: see $OUT/window_only.out" >&2; }

cd "$REPO"
"$PYTHON" benchmarks/scripts/collect_encoder_window.py --runs "$OUT" --task stsb \
    --validation-file "$VALIDATION_FILE" --window "$WINDOW" --sinks "$SINKS" --output "$RESULT" \
    --command "OUT=\$TMPDIR/stsb_window16 WINDOW=$WINDOW SINKS=$SINKS NB_FEATURES=$NB_FEATURES TRANSFER_STEPS=$TRANSFER_STEPS nice -n 10 bash benchmarks/scripts/stsb_window_hybrid.sh (rows e f: HYBRID_ARGS='$HYBRID'; rows b c: CONVERT_ARGS='$WINDOW_ONLY')"
exit "$status"
