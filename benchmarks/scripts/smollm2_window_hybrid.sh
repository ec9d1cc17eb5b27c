#!/usr/bin/env bash
# Sink + sliding-window softmax with a learned linear tail on SmolLM2-135M (issue 15), every arm end to end:
#
#   bash benchmarks/scripts/smollm2_window_hybrid.sh                  # PROFILE=full: the issue's 3-hour CPU budget
#   PROFILE=short bash benchmarks/scripts/smollm2_window_hybrid.sh    # ~1 hour on a 2-core CPU: few steps, all arms
#   PROFILE=tiny bash benchmarks/scripts/smollm2_window_hybrid.sh     # a tiny random Llama, minutes: checks the pipeline
#   LORA_STEPS=100 OUT=/data/runs bash benchmarks/scripts/smollm2_window_hybrid.sh   # any budget is a variable
#   TEACHER_WEIGHT=1 TEACHER_MODEL=softmax_lora bash ...   # the hybrid's LoRA taught by the softmax arm (trained first)
#
# Arms (hf-performer linearize folders under $OUT; softmax zero-shot is the source model itself):
# ARM_NAMES (default: all seven) runs a subset:
#   softmax_zeroshot   $SMOL, no training
#   hybrid_zeroshot    linearize --transfer-steps 0 --lora-steps 0            (converted: sinks + window + tail)
#   window_zeroshot    linearize --no-tail --lora-steps 0  (converted: sinks + window only)
#   softmax_lora       linearize --baseline softmax  (the same LoRA budget on the softmax model: the fair baseline)
#   hybrid_transfer    hybrid_lora's model after its attention transfer, before LoRA (linearize --stop-after transfer,
#                      then the same command continues: no extra training)
#   hybrid_lora        linearize                      (attention transfer of the tail, then LoRA)
#   window_lora        linearize --no-tail            (the tail ablation: the same LoRA budget)
#   hybrid_worst_softmax_lora  (not in the default list) linearize --softmax-worst $SOFTMAX_WORST: the layers the
#                      tail fits worst go back to exact softmax after the transfer, then the same LoRA. It starts from
#                      hybrid_lora's transferred model (the same transfer settings and seed) instead of repeating the
#                      transfer: needs hybrid_transfer and hybrid_lora done first (benchmarks/scripts/reuse_transfer.py)
#
# Evaluations (hf-performer evaluate, one protocol for every arm; linearize's own evaluation is not used):
#   perplexity at 1024 (stride 512) on the first $EVAL_CHARS characters of wiki.test.raw for the trained arms and
#   $ZS_EVAL_CHARS for the zero-shot arms, split by window position ($POSITION_RANGES: positions >= 512 are far beyond
#   the 64-token window); contexts $EXTRA_CONTEXTS (stride context/2, first $EXTRA_CHARS characters) for the arms in
#   $CONTEXT_ARMS; the passkey probe at $PASSKEY_LENGTHS tokens for the arms in $PASSKEY_ARMS.
#
# Every step logs to $OUT/<step>.log, prints its wall time (also in $OUT/timings.tsv) and is skipped when its output
# exists, so an interrupted pipeline resumes where it stopped (linearize also resumes inside a run); delete an output
# to redo its step. The collect step always runs: benchmarks/scripts/collect_window_hybrid.py -> $RESULT (+ .png).
# A finished arm can serve another run (e.g. one softmax baseline for hybrids trained at two windows): link its
# folder into the new $OUT, copy its eval/<arm>_*.json and its timings.tsv rows; its steps are then skipped and the
# collected record names the run it came from (a note and the arm's reused_from).
# Training text: wiki.valid.raw (+ $IMDB_REVIEWS seeded IMDB train reviews); evaluation text: wiki.test.raw.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# The variables a caller may set (recorded in the result's command when set)
KNOWN_VARIABLES=(PROFILE SMOL OUT DATA_DIR TRAIN_FILE TEST_FILE IMDB_FILE IMDB_REVIEWS PYTHON HF_PERFORMER FEATURE_MAP
    NB_FEATURES FEATURE_MAP_INIT WINDOW SINKS TRANSFER_STEPS TRANSFER_LENGTH TRANSFER_BATCH TRANSFER_LR TRANSFER_SCHEDULE
    LORA_STEPS BLOCK BATCH LR SEED
    ARM_NAMES LINEARIZE MAX_TRAIN_CHARS EVAL_CHARS ZS_EVAL_CHARS EXTRA_CHARS EVAL_BATCH POSITION_RANGES EXTRA_CONTEXTS
    CONTEXT_ARMS PASSKEY_ARMS TITLE SOFTMAX_WORST TEACHER_WEIGHT TEACHER_MODEL MIXED_PRECISION
    PASSKEY_LENGTHS PASSKEY_DEPTHS PASSKEY_TRIALS PASSKEY_FILLER RESULT)
COMMAND_ENV=()
for variable in "${KNOWN_VARIABLES[@]}"; do
    if [[ -n "${!variable+set}" ]]; then COMMAND_ENV+=("$variable=${!variable}"); fi
done
COMMAND="${COMMAND_ENV[*]:+${COMMAND_ENV[*]} }bash benchmarks/scripts/smollm2_window_hybrid.sh"

PROFILE="${PROFILE:-full}"
# Sizing (benchmarks/README.md): the softmax model's forward over one 1024-token window costs ~5.4 CPU-seconds here
# (measured: 94 windows of the 1024/512 protocol on 200k characters, 8.5 CPU-minutes); a training sequence of 1024
# tokens ~3x that with LoRA (forward + backward), ~2x for attention transfer.
case "$PROFILE" in
    full)   # ~17,000 CPU-s: about 3 hours on the 2 cores when nothing else runs
        : "${TRANSFER_STEPS:=80}" "${TRANSFER_LENGTH:=1024}" "${TRANSFER_BATCH:=2}" "${LORA_STEPS:=80}"
        : "${BLOCK:=1024}" "${BATCH:=2}" "${EVAL_CHARS:=200000}" "${ZS_EVAL_CHARS:=200000}"
        : "${EXTRA_CHARS:=200000}" "${CONTEXT_ARMS:=softmax_zeroshot hybrid_zeroshot softmax_lora hybrid_lora}"
        : "${PASSKEY_ARMS:=softmax_zeroshot hybrid_zeroshot window_zeroshot softmax_lora hybrid_lora window_lora}"
        PASSKEY_ARMS+=" hybrid_worst_softmax_lora"
        : "${PASSKEY_DEPTHS:=0 0.5 1}" "${PASSKEY_TRIALS:=2}" "${IMDB_REVIEWS:=0}" ;;
    short)  # ~5,300 CPU-s: about 1 hour; all arms, few steps; zero-shot arms and contexts 256/2048 on 50k characters
        : "${TRANSFER_STEPS:=24}" "${TRANSFER_LENGTH:=1024}" "${TRANSFER_BATCH:=2}" "${LORA_STEPS:=24}"
        : "${BLOCK:=1024}" "${BATCH:=2}" "${EVAL_CHARS:=200000}" "${ZS_EVAL_CHARS:=50000}" "${EXTRA_CHARS:=50000}"
        : "${CONTEXT_ARMS:=softmax_lora hybrid_lora hybrid_worst_softmax_lora}"
        : "${PASSKEY_ARMS:=softmax_lora hybrid_lora window_lora hybrid_worst_softmax_lora}"
        : "${PASSKEY_DEPTHS:=0.5}" "${PASSKEY_TRIALS:=2}" "${IMDB_REVIEWS:=0}" ;;
    tiny)   # a tiny random Llama with the GPT-2 tokenizer: the whole pipeline in minutes (numbers mean nothing)
        : "${SMOL:=${OUT:-/tmp/window_hybrid_tiny}/tiny_llama}" "${OUT:=/tmp/window_hybrid_tiny}"
        : "${TRANSFER_STEPS:=2}" "${TRANSFER_LENGTH:=128}" "${TRANSFER_BATCH:=2}" "${LORA_STEPS:=2}"
        : "${BLOCK:=128}" "${BATCH:=2}" "${EVAL_CHARS:=12000}" "${ZS_EVAL_CHARS:=12000}" "${EXTRA_CHARS:=12000}"
        : "${CONTEXT_ARMS:=softmax_zeroshot hybrid_zeroshot softmax_lora hybrid_lora}"
        : "${PASSKEY_ARMS:=softmax_zeroshot hybrid_zeroshot window_zeroshot softmax_lora hybrid_lora window_lora}"
        PASSKEY_ARMS+=" hybrid_worst_softmax_lora"
        : "${PASSKEY_DEPTHS:=0 1}" "${PASSKEY_TRIALS:=1}" "${IMDB_REVIEWS:=20}"
        : "${RESULT:=${OUT}/window_hybrid_tiny.json}" "${TITLE:=tiny random Llama: pipeline check of the window hybrid}" ;;
    *) echo "PROFILE must be full, short or tiny (got '$PROFILE')" >&2; exit 2 ;;
esac

SMOL="${SMOL:-$(dirname "$REPO")/models/smollm2}"       # the float32 SmolLM2-135M folder
OUT="${OUT:-/tmp/window_hybrid_runs}"
DATA_DIR="${DATA_DIR:-$(dirname "$REPO")/shared/data}"
TRAIN_FILE="${TRAIN_FILE:-$DATA_DIR/wikitext-2-raw/wiki.valid.raw}"
TEST_FILE="${TEST_FILE:-$DATA_DIR/wikitext-2-raw/wiki.test.raw}"
IMDB_FILE="${IMDB_FILE:-$DATA_DIR/imdb/train.jsonl.gz}"
PYTHON="${PYTHON:-python}"
HF_PERFORMER="${HF_PERFORMER:-hf-performer}"

# The layer and its training (every trained arm: the same LoRA budget; transfer only for the hybrid)
FEATURE_MAP="${FEATURE_MAP:-hedgehog}"
NB_FEATURES="${NB_FEATURES:-}"            # the tail's features (empty: linearize's default, 2 x head_dim for hedgehog)
FEATURE_MAP_INIT="${FEATURE_MAP_INIT:-}"  # identity (linearize's default; square maps only) or favor+ (any NB_FEATURES)
WINDOW="${WINDOW:-64}"
SINKS="${SINKS:-4}"
TRANSFER_LR="${TRANSFER_LR:-1e-2}"
TRANSFER_SCHEDULE="${TRANSFER_SCHEDULE:-constant}"   # or cosine (decay to 0 over the transfer steps)
LR="${LR:-1e-4}"
SEED="${SEED:-0}"
MIXED_PRECISION="${MIXED_PRECISION:-no}"  # bf16: both training stages under bfloat16 autocast (linearize --mixed-precision)
SOFTMAX_WORST="${SOFTMAX_WORST:-5}"       # layers hybrid_worst_softmax_lora puts back on softmax
MAX_TRAIN_CHARS="${MAX_TRAIN_CHARS:-}"    # cap on the training text (empty: all of it)
TEACHER_WEIGHT="${TEACHER_WEIGHT:-}"      # every trained arm's LoRA stage also learns the teacher's next-token
                                          # distributions (linearize --teacher-weight; empty: off)
TEACHER_MODEL="${TEACHER_MODEL:-}"        # the teacher: empty = SmolLM2 itself; an arm's name (softmax_lora: the
                                          # softmax model after the same LoRA stage, trained first and untaught);
                                          # or a model folder
if [[ -n "$TEACHER_MODEL" && -z "$TEACHER_WEIGHT" ]]; then
    echo "TEACHER_MODEL=$TEACHER_MODEL needs TEACHER_WEIGHT (the teacher term's weight, e.g. 1)" >&2; exit 2
fi

# Evaluation
ARM_NAMES="${ARM_NAMES:-softmax_zeroshot hybrid_zeroshot window_zeroshot softmax_lora hybrid_transfer hybrid_lora window_lora}"
EVAL_BATCH="${EVAL_BATCH:-2}"              # windows (or passkey prompts) per forward pass
POSITION_RANGES="${POSITION_RANGES:-0:512 512:1024}"
EXTRA_CONTEXTS="${EXTRA_CONTEXTS:-256 2048}"
PASSKEY_LENGTHS="${PASSKEY_LENGTHS:-1024 2048}"
PASSKEY_FILLER="${PASSKEY_FILLER:-}"       # a text file for the filler (empty: the classic repeated sentences)
RESULT="${RESULT:-$REPO/benchmarks/results/window_hybrid_smollm2.json}"
TITLE="${TITLE:-SmolLM2-135M: sink + sliding-window softmax with a learned linear tail}"

mkdir -p "$OUT/eval"
cd "$REPO"
TIMINGS="$OUT/timings.tsv"
PIPELINE_START=$SECONDS

# shellcheck source=pipeline_steps.sh
source "$REPO/benchmarks/scripts/pipeline_steps.sh"

log "window hybrid ($PROFILE profile): SMOL=$SMOL OUT=$OUT"
log "transfer $TRANSFER_STEPS steps x $TRANSFER_BATCH x $TRANSFER_LENGTH tokens (lr $TRANSFER_LR, $TRANSFER_SCHEDULE); LoRA $LORA_STEPS" \
    "steps x $BATCH x $BLOCK tokens (lr $LR); window $WINDOW, sinks $SINKS, $FEATURE_MAP; eval: context 1024 on" \
    "$EVAL_CHARS chars (trained), $ZS_EVAL_CHARS chars (zero-shot); contexts $EXTRA_CONTEXTS on $EXTRA_CHARS chars" \
    "for $CONTEXT_ARMS;" \
    "passkey $PASSKEY_LENGTHS for $PASSKEY_ARMS"
for file in "$TRAIN_FILE" "$TEST_FILE"; do
    [[ -f "$file" ]] || { log "missing data file $file (set DATA_DIR / TRAIN_FILE / TEST_FILE)"; exit 1; }
done

if [[ "$PROFILE" == tiny ]]; then
    run_step tiny_model "$SMOL/config.json" "$PYTHON" -c '
import sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=4096,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
LlamaForCausalLM(config).save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
print("tiny random Llama:", sum(p.numel() for p in LlamaForCausalLM(config).parameters()), "parameters")
' "$SMOL" "$DATA_DIR/gpt2-tokenizer"
fi
[[ -f "$SMOL/config.json" ]] || { log "no model folder at $SMOL (set SMOL)"; exit 1; }

TRAIN_ARGS=(--train-file "$TRAIN_FILE")
if [[ "$IMDB_REVIEWS" != 0 ]]; then
    IMDB_TEXT="$OUT/imdb_train_${IMDB_REVIEWS}_reviews.txt"
    run_step imdb_text "$IMDB_TEXT" "$PYTHON" -c '
import random, sys
from hf_performer.tasks.data import read_records
rows = read_records(sys.argv[1])
reviews = [row["text"].replace("<br />", " ").strip() for row in rows]
chosen = random.Random(int(sys.argv[3])).sample(range(len(reviews)), int(sys.argv[2]))
with open(sys.argv[4], "w", encoding="utf-8") as handle:
    handle.write("\n\n".join(reviews[i] for i in sorted(chosen)) + "\n")
print(len(chosen), "of", len(reviews), "IMDB train reviews (seeded sample)")
' "$IMDB_FILE" "$IMDB_REVIEWS" "$SEED" "$IMDB_TEXT"
    TRAIN_ARGS+=(--train-file "$IMDB_TEXT")
fi
mapfile -t TRAIN_CHAR_ARGS < <(optional --max-train-chars "$MAX_TRAIN_CHARS")
TEACHER_FOLDER="$TEACHER_MODEL"
if [[ -n "$TEACHER_MODEL" && " softmax_lora hybrid_lora window_lora hybrid_worst_softmax_lora " == *" $TEACHER_MODEL "* ]]
then
    TEACHER_FOLDER="$OUT/$TEACHER_MODEL"
fi
teacher_args() {  # teacher_args ARM: ARM's LoRA teacher flags (none for zero-shot arms and for the teacher's own arm)
    [[ -n "$TEACHER_WEIGHT" && "$1" != *_zeroshot && "$1" != "$TEACHER_MODEL" ]] || return 0
    printf '%s\n' --teacher-weight "$TEACHER_WEIGHT"
    optional --teacher-model "$TEACHER_FOLDER"
}

# shellcheck disable=SC2206 # LINEARIZE is a command line (e.g. another installation's "hf-performer linearize")
LINEARIZE_COMMAND=(${LINEARIZE:-$HF_PERFORMER linearize})
linearize() {  # linearize ARM EXTRA_ARGS...: every arm gets the same data and LoRA arguments
    local arm="$1"
    shift
    local teacher=()
    mapfile -t teacher < <(teacher_args "$arm")
    show_and_run "${LINEARIZE_COMMAND[@]}" "$SMOL" "$OUT/$arm" "${TRAIN_ARGS[@]}" "${TRAIN_CHAR_ARGS[@]}" "${teacher[@]}" \
        --block-size "$BLOCK" --batch-size "$BATCH" --learning-rate "$LR" --seed "$SEED" --mixed-precision "$MIXED_PRECISION" \
        --no-progress "$@"
}
HYBRID_ARGS=(--feature-map "$FEATURE_MAP" --window "$WINDOW" --sinks "$SINKS" --transfer-length "$TRANSFER_LENGTH"
             --transfer-batch-size "$TRANSFER_BATCH" --transfer-learning-rate "$TRANSFER_LR"
             --transfer-schedule "$TRANSFER_SCHEDULE")
mapfile -t -O "${#HYBRID_ARGS[@]}" HYBRID_ARGS < <(optional --nb-features "$NB_FEATURES"
                                                  optional --feature-map-init "$FEATURE_MAP_INIT")

perplexity() {  # perplexity MODEL OUTPUT.json CONTEXT CHARS [--position-ranges ...]
    local model="$1" output="$2" context="$3" chars="$4"
    shift 4
    show_and_run "$HF_PERFORMER" evaluate "$model" --task wikitext --text-file "$TEST_FILE" --context-length "$context" \
        --stride $((context / 2)) --max-chars "$chars" --batch-size "$EVAL_BATCH" --no-progress "$@" --output "$output"
}

passkey() {  # passkey MODEL OUTPUT.json
    local filler=()
    if [[ -n "$PASSKEY_FILLER" ]]; then filler=(--text-file "$PASSKEY_FILLER"); fi
    # shellcheck disable=SC2086 # the lists are space-separated on purpose
    show_and_run "$HF_PERFORMER" evaluate "$1" --task passkey --context-lengths $PASSKEY_LENGTHS \
        --depths $PASSKEY_DEPTHS --trials "$PASSKEY_TRIALS" --seed "$SEED" "${filler[@]}" --batch-size "$EVAL_BATCH" \
        --no-progress --output "$2"
}

# shellcheck disable=SC2206 # space-separated on purpose
ARMS=($ARM_NAMES)
wants() { [[ " $ARM_NAMES " == *" $1 "* ]]; }
for arm in "${ARMS[@]}"; do
    case "$arm" in
        softmax_zeroshot|hybrid_zeroshot|window_zeroshot|softmax_lora|hybrid_transfer|hybrid_lora|window_lora) ;;
        hybrid_worst_softmax_lora) ;;
        *) log "unknown arm '$arm' in ARM_NAMES; accepted: softmax_zeroshot hybrid_zeroshot window_zeroshot" \
               "softmax_lora hybrid_transfer hybrid_lora window_lora hybrid_worst_softmax_lora"; exit 2 ;;
    esac
done

# Training (and conversion) of each arm: the zero-shot ones first (cheap), then the trained ones
if wants hybrid_zeroshot; then
    run_step linearize_hybrid_zeroshot "$OUT/hybrid_zeroshot/linearize.json" \
        linearize hybrid_zeroshot "${HYBRID_ARGS[@]}" --transfer-steps 0 --lora-steps 0
fi
if wants window_zeroshot; then
    run_step linearize_window_zeroshot "$OUT/window_zeroshot/linearize.json" \
        linearize window_zeroshot --window "$WINDOW" --sinks "$SINKS" --no-tail --lora-steps 0
fi
if wants softmax_lora; then
    run_step linearize_softmax_lora "$OUT/softmax_lora/linearize.json" \
        linearize softmax_lora --baseline softmax --lora-steps "$LORA_STEPS"
fi
transferred_model() {  # hybrid_lora's run up to its transfer stage; its transferred model becomes the arm's folder
    linearize hybrid_lora "${HYBRID_ARGS[@]}" --transfer-steps "$TRANSFER_STEPS" --lora-steps "$LORA_STEPS" \
        --stop-after transfer
    rm -rf "$OUT/hybrid_transfer.partial"
    cp -a "$OUT/.hybrid_lora.linearize/transferred" "$OUT/hybrid_transfer.partial"
    mv "$OUT/hybrid_transfer.partial" "$OUT/hybrid_transfer"
}
if wants hybrid_transfer; then
    if [[ -e "$OUT/hybrid_lora/linearize.json" && ! -e "$OUT/hybrid_transfer/config.json" ]]; then
        log "hybrid_transfer: hybrid_lora already finished without it (its staging area is gone); delete" \
            "$OUT/hybrid_lora to redo both, or drop hybrid_transfer from ARM_NAMES"
        exit 1
    fi
    run_step linearize_hybrid_transfer "$OUT/hybrid_transfer/config.json" transferred_model
fi
if wants hybrid_lora; then
    run_step linearize_hybrid_lora "$OUT/hybrid_lora/linearize.json" \
        linearize hybrid_lora "${HYBRID_ARGS[@]}" --transfer-steps "$TRANSFER_STEPS" --lora-steps "$LORA_STEPS"
fi
worst_softmax_model() {  # hybrid_lora's transferred model, --softmax-worst layers back on softmax, then LoRA
    local arm=hybrid_worst_softmax_lora
    local args=("${HYBRID_ARGS[@]}" --transfer-steps "$TRANSFER_STEPS" --lora-steps "$LORA_STEPS" --softmax-worst \
                "$SOFTMAX_WORST")
    if [[ ! -e "$OUT/.$arm.linearize/run.json" ]]; then
        for needed in "$OUT/hybrid_transfer/config.json" "$OUT/hybrid_lora/linearize.json"; do
            [[ -e "$needed" ]] || { log "$arm starts from hybrid_lora's transfer: $needed is missing (run" \
                                        "hybrid_transfer and hybrid_lora first)"; return 1; }
        done
        linearize "$arm" "${args[@]}" --stop-after convert
        show_and_run "$PYTHON" benchmarks/scripts/reuse_transfer.py "$OUT/.$arm.linearize" \
            --record "$OUT/hybrid_lora/linearize.json" --model "$OUT/hybrid_transfer"
    fi
    linearize "$arm" "${args[@]}"
}
if wants hybrid_worst_softmax_lora; then
    run_step linearize_hybrid_worst_softmax_lora "$OUT/hybrid_worst_softmax_lora/linearize.json" worst_softmax_model
fi
if wants window_lora; then
    run_step linearize_window_lora "$OUT/window_lora/linearize.json" linearize window_lora \
        --window "$WINDOW" --sinks "$SINKS" --no-tail --lora-steps "$LORA_STEPS"
fi

model_of() { if [[ "$1" == softmax_zeroshot ]]; then echo "$SMOL"; else echo "$OUT/$1"; fi; }
chars_of() { if [[ "$1" == *_zeroshot || "$1" == hybrid_transfer ]]; then echo "$ZS_EVAL_CHARS"; else echo "$EVAL_CHARS"; fi; }
# shellcheck disable=SC2206 # space-separated on purpose
POSITION_ARGS=(--position-ranges $POSITION_RANGES)

COLLECT_ARGS=()
for arm in "${ARMS[@]}"; do
    if [[ "$arm" == *_lora || "$arm" == hybrid_zeroshot || "$arm" == window_zeroshot ]]; then
        COLLECT_ARGS+=(--arm "$arm=$OUT/$arm")  # a linearize output folder (linearize.json)
    fi
    output="$OUT/eval/${arm}_ctx1024.json"
    run_step "eval_${arm}_ctx1024" "$output" \
        perplexity "$(model_of "$arm")" "$output" 1024 "$(chars_of "$arm")" "${POSITION_ARGS[@]}"
    COLLECT_ARGS+=(--eval "$arm=$output")
done
for arm in "${ARMS[@]}"; do
    [[ " $PASSKEY_ARMS " == *" $arm "* ]] || continue
    output="$OUT/eval/${arm}_passkey.json"
    run_step "passkey_${arm}" "$output" passkey "$(model_of "$arm")" "$output"
    COLLECT_ARGS+=(--eval "$arm=$output")
done
for arm in "${ARMS[@]}"; do
    [[ " $CONTEXT_ARMS " == *" $arm "* ]] || continue
    for context in $EXTRA_CONTEXTS; do
        output="$OUT/eval/${arm}_ctx${context}.json"
        run_step "eval_${arm}_ctx${context}" "$output" perplexity "$(model_of "$arm")" "$output" "$context" "$EXTRA_CHARS"
        COLLECT_ARGS+=(--eval "$arm=$output")
    done
done

PROTOCOL="WikiText-2 raw test ($(basename "$TEST_FILE")): perplexity with windows of C tokens every C/2 (each token \
scored once, token-weighted; hf_performer.tasks.evaluation), C = 1024 on the first $EVAL_CHARS characters for the \
trained arms and $ZS_EVAL_CHARS for the zero-shot arms, split by window position ($POSITION_RANGES, every window's \
predictions); contexts $EXTRA_CONTEXTS on the first $EXTRA_CHARS characters for $CONTEXT_ARMS. Passkey: $PASSKEY_LENGTHS tokens, depths $PASSKEY_DEPTHS, \
$PASSKEY_TRIALS seeded trials each, filler ${PASSKEY_FILLER:+$(basename "$PASSKEY_FILLER")}${PASSKEY_FILLER:-classic \
repeated sentences}. Training text: $(basename "$TRAIN_FILE")${IMDB_TEXT:+ + $IMDB_REVIEWS IMDB train reviews}. \
hf-performer linearize: $FEATURE_MAP tail${NB_FEATURES:+ ($NB_FEATURES features, ${FEATURE_MAP_INIT:-identity} start)}, window $WINDOW, sinks $SINKS; attention transfer $TRANSFER_STEPS steps x \
$TRANSFER_BATCH x $TRANSFER_LENGTH tokens (lr $TRANSFER_LR, $TRANSFER_SCHEDULE, hybrid only); LoRA $LORA_STEPS steps x $BATCH x $BLOCK \
tokens (lr $LR), identical for the three trained arms; seed $SEED; training precision $MIXED_PRECISION (evaluation \
float32)."
if [[ -n "$TEACHER_WEIGHT" ]]; then
    PROTOCOL+=" LoRA stage taught by ${TEACHER_MODEL:-the source model} (linearize --teacher-weight $TEACHER_WEIGHT: \
T^2 KL at T = 2 on the next-token distributions, added to the language-modelling loss) in every trained arm\
${TEACHER_MODEL:+ but $TEACHER_MODEL itself}."
fi

NOTES=()
if [[ "$ZS_EVAL_CHARS" != "$EVAL_CHARS" ]]; then
    NOTES+=(--note "$PROFILE profile: the zero-shot arms were evaluated on the first $ZS_EVAL_CHARS characters, the \
trained arms on $EVAL_CHARS: zero-shot rows compare with each other, not with the trained rows")
fi
if [[ "$EXTRA_CHARS" != "$EVAL_CHARS" ]]; then
    NOTES+=(--note "$PROFILE profile: contexts $EXTRA_CONTEXTS were evaluated on the first $EXTRA_CHARS characters only")
fi

ALWAYS=1 run_step collect "$RESULT" \
    "$PYTHON" benchmarks/scripts/collect_window_hybrid.py "${COLLECT_ARGS[@]}" --timings "$TIMINGS" --runs-dir "$OUT" \
    --profile "$PROFILE" --protocol "$PROTOCOL" --command "$COMMAND" "${NOTES[@]}" --title "$TITLE" --output "$RESULT"
tail -n 20 "$OUT/collect.log"
log "pipeline done in $((SECONDS - PIPELINE_START)) s (step timings: $TIMINGS)"
