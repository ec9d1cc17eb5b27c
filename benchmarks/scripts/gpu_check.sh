#!/usr/bin/env bash
# The GPU check of the CUDA path in one run on a lent GPU (benchmarks/README.md, "GPU"): the cuda tests, the attention
# bench (bf16, both linear backends, forward + backward and forward only), a profile of kernel against wall time, and
# the SmolLM2-shaped model timings. Every stage has its own time limit and the results are packed after each stage,
# so a stage cut short keeps what the others measured.
#
# Run from the repository root, with the wheels in .whl/ (the machine is offline):
#   pip wheel --no-deps . -w .whl        # this project
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       transformers==5.24.0 fla-core==0.6.0 flash-linear-attention==0.6.0 -d .whl
#   benchmarks/scripts/gpu_check.sh RESULTS_DIR [smoke | core]
# RESULTS_DIR receives gpu_check.log and gpu_results.tgz (gpu_*.json and .png for benchmarks/results, and the logs).
# "smoke": the tests, a profile and small lengths only (about two minutes): a check that every stage runs before the
# full run (about nine minutes); "core": the tests, the attention bench with memory and a profile (about five).
set -u
results=${1:?usage: gpu_check.sh RESULTS_DIR [smoke]}
mode=${2:-full}
mkdir -p "$results"
work=$(mktemp -d)
exec > >(tee -a "$results/gpu_check.log") 2>&1

site=/tmp/hf_performer_site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "gpu_check: installing the carried wheels failed"; exit 1; }
export PYTHONPATH="$site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg
python3 - <<'EOF'
import torch, transformers, triton, hf_performer
print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__,
      "device", torch.cuda.get_device_name())
try:
    import fla
    print("fla", fla.__version__)
except Exception as error:
    print("fla unavailable:", error)
EOF

pack() { tar czf "$results/gpu_results.tgz" -C "$work" . ; }
stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $(date +%T) $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$work/$name.log" 2>&1
    local status=$?
    echo "== $(date +%T) $name rc=$status"
    tail -n 40 "$work/$name.log"
    pack
}

if [ "$mode" = core ]; then  # the tests, the forward + backward bench of every kind with memory, a 16k profile
    lengths=4096,16384,65536; limit=(100 50 150 0 0 0)
elif [ "$mode" = smoke ]; then
    lengths=4096; train=1024; prefill=4096; contexts=512; batches=1; limit=(90 40 60 30 30 90)
else
    lengths=4096,16384,65536; train=2048,8192; prefill=16384; contexts=512,16384; batches=1,8
    limit=(80 50 140 50 50 150)  # with the install, inside one 600 s device call
fi
bench="python3 -m hf_performer.cli bench attention --device cuda --dtype bfloat16 --repeats 3 --lengths $lengths"

stage cuda_tests "${limit[0]}" python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_path.py
stage profile "${limit[1]}" python3 benchmarks/scripts/gpu_profile.py --length 16384 \
    --output "$work/gpu_profile.json"
stage attention "${limit[2]}" $bench --implementations sdpa favor window window-cache --output-dir "$work" \
    --name gpu_attention_bf16
[ "${limit[3]}" = 0 ] && { echo "== $(date +%T) done"; exit 0; }
stage attention_torch_backend "${limit[3]}" env HF_PERFORMER_LINEAR_BACKEND=torch $bench --implementations sdpa \
    favor --no-memory --output-dir "$work" --name gpu_attention_bf16_torch_backend
stage attention_forward "${limit[4]}" $bench --implementations sdpa favor window window-cache --forward-only \
    --no-memory --output-dir "$work" --name gpu_attention_bf16_forward
stage model "${limit[5]}" python3 benchmarks/scripts/gpu_model_speed.py --output "$work/gpu_model_speed.json" \
    --conversions window64_g256 window64_tail --train-lengths "$train" --prefill-lengths "$prefill" \
    --decode-contexts "$contexts" --decode-batches "$batches" --repeats 2
echo "== $(date +%T) done"
