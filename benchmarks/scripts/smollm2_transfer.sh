#!/usr/bin/env bash
# Attention transfer on a real causal LM (SmolLM2-135M: Llama, 30 layers, 9 query / 3 KV heads), end to end:
#
#   bash benchmarks/scripts/smollm2_transfer.sh                    # defaults below
#   STEPS=400 EVAL_CHARS= OUT=/data/runs bash benchmarks/scripts/smollm2_transfer.sh
#
# Steps, in order (each logs to $OUT/<step>.log, prints its wall time, and is skipped when its output exists, so an
# interrupted pipeline resumes where it stopped; delete an output to redo its step):
#
#   dequantize          $SMOL/config.json                  the float32 folder from the GGUF file (only if missing)
#   eval_softmax_base   $OUT/eval_softmax_base.json        perplexity of the softmax model, not fine-tuned
#   distill             $OUT/transfer_$FEATURE_MAP/        hf-performer distill: learned feature map by attention transfer
#   eval_transfer       $OUT/eval_transfer.json            perplexity of the transfer folder, not fine-tuned
#   finetune_softmax    $OUT/finetune_softmax/metrics.json recipe, --attention softmax on $SMOL
#   finetune_transfer   $OUT/finetune_transfer/metrics.json recipe on the transfer folder (same args, steps, data)
#   [RUN_FAVOR=1: convert_favor, eval_favor_base, finetune_favor: the same for a plain FAVOR+ conversion]
#   samples             $OUT/samples.json                  greedy continuations of the base and fine-tuned models
#   collect             $RESULT (+ .png)                   always re-run (it only reads the files above)
#
# Data: wiki.valid.raw trains (transfer and fine-tuning; there is no offline train split), wiki.test.raw evaluates.
# Every perplexity (evaluate and the recipes' final evaluation) uses the same protocol: the first $EVAL_CHARS
# characters of wiki.test.raw, windows of $CONTEXT tokens every $STRIDE tokens (hf_performer.tasks.evaluation). The recipes
# evaluate on the test text every $EVAL_STEPS steps for the curve only; the final model is the last step's.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

SMOL="${SMOL:-/tmp/smollm2}"
OUT="${OUT:-/tmp/smollm2_runs}"
DATA_DIR="${DATA_DIR:-$(dirname "$REPO")/shared/data/wikitext-2-raw}"
TRAIN_FILE="${TRAIN_FILE:-$DATA_DIR/wiki.valid.raw}"
TEST_FILE="${TEST_FILE:-$DATA_DIR/wiki.test.raw}"
PYTHON="${PYTHON:-python}"
HF_PERFORMER="${HF_PERFORMER:-hf-performer}"

# Fine-tuning (both runs: identical arguments)
STEPS="${STEPS:-200}"                    # optimizer steps
BATCH="${BATCH:-8}"                      # sequences per step
BLOCK="${BLOCK:-256}"                    # tokens per training sequence
LR="${LR:-1e-4}"                         # peak learning rate (linear decay, 6% warmup)
SEED="${SEED:-42}"
EVAL_STEPS="${EVAL_STEPS:-100}"          # evaluate every N steps for the curve (empty: only at the end)
CHECKPOINT_STEPS="${CHECKPOINT_STEPS:-}" # save resumable checkpoints every N steps (empty: none)

# Evaluation protocol (every perplexity)
CONTEXT="${CONTEXT:-256}"                # tokens per window
STRIDE="${STRIDE:-128}"                  # tokens between window starts
EVAL_CHARS="${EVAL_CHARS:-200000}"       # first N characters of wiki.test.raw (empty: all of it)
EVAL_BATCH="${EVAL_BATCH:-8}"            # windows per forward pass (49k vocabulary: logits are 200 kB per token)

# Attention transfer (hf-performer distill)
FEATURE_MAP="${FEATURE_MAP:-hedgehog}"
FEATURE_MAP_INIT="${FEATURE_MAP_INIT:-favor+}"  # learned maps: start as FAVOR+ (or identity, the Hedgehog paper's start)
NB_FEATURES="${NB_FEATURES:-256}"              # learned maps: features per head (empty: the map's default, 2 x head_dim)
TRANSFER_SAMPLES="${TRANSFER_SAMPLES:-512}"  # training sequences
TRANSFER_LENGTH="${TRANSFER_LENGTH:-$BLOCK}" # tokens per sequence
TRANSFER_BATCH="${TRANSFER_BATCH:-8}"
TRANSFER_STEPS="${TRANSFER_STEPS:-256}"
TRANSFER_LR="${TRANSFER_LR:-1e-2}"

# Generations, optional FAVOR+ rows, output
SAMPLE_TOKENS="${SAMPLE_TOKENS:-40}"
RUN_FAVOR="${RUN_FAVOR:-0}"              # 1: also convert to FAVOR+ (random features), evaluate and fine-tune it
RESULT="${RESULT:-$REPO/benchmarks/results/attention_transfer_smollm2.json}"
PREVIOUS="${PREVIOUS:-}"                 # space-separated earlier results of this pipeline (other transfer budgets)

TRANSFER_DIR="$OUT/transfer_$FEATURE_MAP"
mkdir -p "$OUT"
cd "$REPO"
TIMINGS="$OUT/timings.tsv"
PIPELINE_START=$SECONDS

# shellcheck source=pipeline_steps.sh
source "$REPO/benchmarks/scripts/pipeline_steps.sh"

mapfile -t EVAL_CHAR_ARGS < <(optional --max-chars "$EVAL_CHARS")
mapfile -t RECIPE_CHAR_ARGS < <(optional --max-eval-chars "$EVAL_CHARS")
mapfile -t EVAL_STEP_ARGS < <(optional --eval-steps "$EVAL_STEPS")
mapfile -t FEATURE_ARGS < <(optional --feature-map-init "$FEATURE_MAP_INIT"; optional --nb-features "$NB_FEATURES")

evaluate() {  # evaluate MODEL OUTPUT.json
    show_and_run "$HF_PERFORMER" evaluate "$1" --task wikitext --text-file "$TEST_FILE" --context-length "$CONTEXT" \
        --stride "$STRIDE" --batch-size "$EVAL_BATCH" "${EVAL_CHAR_ARGS[@]}" --output "$2"
}

finetune() {  # finetune OUTPUT_DIR RECIPE_ARGS...: the same recipe arguments for every fine-tuning run
    local output_dir="$1"
    shift
    local extra=()
    if [[ -n "$CHECKPOINT_STEPS" ]]; then
        extra+=(--checkpointing-steps "$CHECKPOINT_STEPS")
        if compgen -G "$output_dir/checkpoints/step_*/training_state.json" >/dev/null; then
            extra+=(--resume-from-checkpoint latest)
        fi
    fi
    if [[ " ${extra[*]} " != *" --resume-from-checkpoint "* ]]; then
        extra+=(--overwrite)  # a fresh run: replace what an earlier (ALWAYS=1 or failed) run left there
    fi
    show_and_run "$PYTHON" recipes/causal_lm.py "$@" --train-file "$TRAIN_FILE" --validation-file "$TEST_FILE" \
        --block-size "$BLOCK" --max-train-steps "$STEPS" --per-device-train-batch-size "$BATCH" \
        --per-device-eval-batch-size "$EVAL_BATCH" --learning-rate "$LR" --context-length "$CONTEXT" \
        --stride "$STRIDE" "${RECIPE_CHAR_ARGS[@]}" "${EVAL_STEP_ARGS[@]}" --seed "$SEED" --report-to none \
        "${extra[@]}" --output-dir "$output_dir"
}

log "SmolLM2 attention transfer: SMOL=$SMOL OUT=$OUT"
log "fine-tuning: $STEPS steps x $BATCH x $BLOCK tokens, lr $LR, seed $SEED; eval: context $CONTEXT, stride $STRIDE," \
    "chars ${EVAL_CHARS:-all}; transfer: $FEATURE_MAP (init ${FEATURE_MAP_INIT:-default}, ${NB_FEATURES:-default}" \
    "features), $TRANSFER_SAMPLES x $TRANSFER_LENGTH tokens," \
    "$TRANSFER_STEPS steps x $TRANSFER_BATCH, lr $TRANSFER_LR"
for file in "$TRAIN_FILE" "$TEST_FILE"; do
    [[ -f "$file" ]] || { log "missing data file $file (set DATA_DIR / TRAIN_FILE / TEST_FILE)"; exit 1; }
done

run_step dequantize "$SMOL/config.json" \
    "$PYTHON" benchmarks/scripts/dequantize_gguf.py --output "$SMOL"

run_step eval_softmax_base "$OUT/eval_softmax_base.json" evaluate "$SMOL" "$OUT/eval_softmax_base.json"

run_step distill "$TRANSFER_DIR/attention_transfer.json" \
    "$HF_PERFORMER" distill "$SMOL" "$TRANSFER_DIR" --feature-map "$FEATURE_MAP" "${FEATURE_ARGS[@]}" \
    --data "$TRAIN_FILE" --data-task text --max-length "$TRANSFER_LENGTH" --max-samples "$TRANSFER_SAMPLES" --batch-size "$TRANSFER_BATCH" \
    --steps "$TRANSFER_STEPS" --learning-rate "$TRANSFER_LR" --no-progress --overwrite

run_step eval_transfer "$OUT/eval_transfer.json" evaluate "$TRANSFER_DIR" "$OUT/eval_transfer.json"

run_step finetune_softmax "$OUT/finetune_softmax/metrics.json" \
    finetune "$OUT/finetune_softmax" --model "$SMOL" --attention softmax

run_step finetune_transfer "$OUT/finetune_transfer/metrics.json" \
    finetune "$OUT/finetune_transfer" --model "$TRANSFER_DIR"

SAMPLE_MODELS=(--model "softmax_base=$SMOL" --model "transfer=$TRANSFER_DIR"
               --model "softmax_finetuned=$OUT/finetune_softmax" --model "transfer_finetuned=$OUT/finetune_transfer")
FAVOR_ARGS=()
if [[ "$RUN_FAVOR" == "1" ]]; then
    run_step convert_favor "$OUT/favor_base/config.json" \
        "$HF_PERFORMER" convert "$SMOL" "$OUT/favor_base" --feature-map favor+ --overwrite
    run_step eval_favor_base "$OUT/eval_favor_base.json" evaluate "$OUT/favor_base" "$OUT/eval_favor_base.json"
    run_step finetune_favor "$OUT/finetune_favor/metrics.json" \
        finetune "$OUT/finetune_favor" --model "$SMOL" --attention favor --feature-map favor+
    SAMPLE_MODELS+=(--model "favor_finetuned=$OUT/finetune_favor")
    FAVOR_ARGS=(--favor-base "$OUT/eval_favor_base.json" --favor-finetuned "$OUT/finetune_favor")
fi

run_step samples "$OUT/samples.json" \
    "$PYTHON" benchmarks/scripts/greedy_samples.py "${SAMPLE_MODELS[@]}" --max-new-tokens "$SAMPLE_TOKENS" \
    --output "$OUT/samples.json"

PROTOCOL="Perplexity on the first ${EVAL_CHARS:-all} characters of $(basename "$TEST_FILE") (WikiText-2 raw test), \
windows of $CONTEXT tokens every $STRIDE tokens, each token scored once, token-weighted (hf_performer.tasks.evaluation). \
Fine-tuning: recipes/causal_lm.py on $(basename "$TRAIN_FILE") (WikiText-2 raw validation: no train split offline), \
$STEPS steps x $BATCH sequences x $BLOCK tokens, lr $LR (linear decay, 6% warmup), seed $SEED, identical for both runs. \
Attention transfer: hf-performer distill --feature-map $FEATURE_MAP ${FEATURE_ARGS[*]}, $TRANSFER_SAMPLES sequences of $TRANSFER_LENGTH \
tokens of $(basename "$TRAIN_FILE"), $TRANSFER_STEPS steps x $TRANSFER_BATCH, lr $TRANSFER_LR, feature maps only."

PREVIOUS_ARGS=()
for previous in $PREVIOUS; do
    PREVIOUS_ARGS+=(--previous "$previous")
done

# collect always runs (it only reads the outputs above); the previous result stays if it fails
ALWAYS=1 run_step collect "$RESULT" \
    "$PYTHON" benchmarks/scripts/collect_lm_transfer.py --softmax-base "$OUT/eval_softmax_base.json" \
    --softmax-finetuned "$OUT/finetune_softmax" --transfer "$OUT/eval_transfer.json" --transfer-folder "$TRANSFER_DIR" \
    --transfer-finetuned "$OUT/finetune_transfer" "${FAVOR_ARGS[@]}" "${PREVIOUS_ARGS[@]}" --samples "$OUT/samples.json" \
    --protocol "$PROTOCOL" --output "$RESULT"
tail -n 12 "$OUT/collect.log"
log "pipeline done in $((SECONDS - PIPELINE_START)) s (step timings: $TIMINGS)"
