#!/usr/bin/env bash
# Run THERE (the GPU machine, through the device tool), after benchmarks/gpu/prepare.sh here:
#
#   run(command="bash benchmarks/gpu/run.sh suite bench", carry=[".whl", ".gpu"], timeout_s=600)
#
# Installs the carried wheels and aserve (no network there), writes random-weight 1B/8B Llama folders,
# then runs the stages named (each bounded so a call stays inside the tool's 10 minutes; split stages
# over calls as the device time allows) and writes $OUT/results.md plus one log per stage:
#   suite    the test suite on CUDA (tests needing the bundled model skip: it is not carried)
#   layers   the Triton layer kernels inside the served model (a profiler test) and the CUDA-only tests
#   offline  1B offline throughput, 128 prompts x 512 in / 256 out (`aserve bench throughput`)
#   serve    8B server (dummy weights): time to ready, c=1 ITL (16 prompts), c=128 (300 in / 256 out)
#   kernels  benchmarks/kernels.py (decode and prefill attention vs SDPA, every shape)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RESULTS=$OUT/results.md
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site ASERVE_LOG_LEVEL=${ASERVE_LOG_LEVEL:-WARNING}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed" | tee -a "$RESULTS"; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . \
  || { echo "aserve install failed" | tee -a "$RESULTS"; exit 1; }
export PATH=/tmp/site/bin:$PATH
python3 benchmarks/gpu/make_models.py /tmp/models > /dev/null
{ echo "# aserve on $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader), $(date -u +%F)";
  python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')"; } >> "$RESULTS"

stage_suite() {
  timeout 540 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 300 tests > "$OUT/suite.log" 2>&1
  echo "- suite (exit $?): $(tail -1 "$OUT/suite.log")" >> "$RESULTS"
}
stage_layers() {
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/model/layers tests/runner/test_cuda_paths.py \
    tests/kernels > "$OUT/layers.log" 2>&1
  echo "- layer kernels and CUDA paths (exit $?): $(tail -1 "$OUT/layers.log")" >> "$RESULTS"
}
stage_offline() {
  timeout 400 aserve bench throughput --model /tmp/models/1b --load-format dummy --dtype bfloat16 \
    --input-len 512 --output-len 256 --num-prompts 128 --output-json "$OUT/offline_1b.json" > "$OUT/offline.log" 2>&1
  echo "- 1B offline (exit $?): $(grep -i 'throughput' "$OUT/offline.log" | tail -2 | tr '\n' ' ')" >> "$RESULTS"
}
stage_serve() {
  local start ready port=8011
  start=$(date +%s.%N)
  aserve --model /tmp/models/8b --load-format dummy --dtype bfloat16 --port $port --disable-log-requests \
    > "$OUT/server_8b.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    sleep 0.5; kill -0 $pid 2> /dev/null || { echo "- 8B server died: $(tail -3 "$OUT/server_8b.log")" >> "$RESULTS"; return; }
  done
  ready=$(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')")
  echo "- 8B dummy ready after ${ready} s" >> "$RESULTS"
  timeout 200 aserve bench serve --base-url "http://127.0.0.1:$port" --tokenizer /tmp/models/8b --num-prompts 16 \
    --max-concurrency 1 --random-input-len 128 --random-output-len 128 --ignore-eos --disable-tqdm \
    > "$OUT/serve_c1.log" 2>&1
  echo "- 8B c=1: $(grep -iE 'ITL|output token throughput' "$OUT/serve_c1.log" | tr -s ' ' | tr '\n' ';')" >> "$RESULTS"
  timeout 300 aserve bench serve --base-url "http://127.0.0.1:$port" --tokenizer /tmp/models/8b --num-prompts 512 \
    --max-concurrency 128 --random-input-len 300 --random-output-len 256 --ignore-eos --disable-tqdm \
    > "$OUT/serve_c128.log" 2>&1
  echo "- 8B c=128: $(grep -iE 'TTFT|output token throughput' "$OUT/serve_c128.log" | tr -s ' ' | tr '\n' ';')" >> "$RESULTS"
  kill $pid; wait $pid 2> /dev/null
}
stage_kernels() {
  timeout 400 python3 benchmarks/kernels.py > "$OUT/kernels.md" 2>&1
  echo "- kernels (exit $?): see kernels.md" >> "$RESULTS"
}

for stage in "$@"; do
  case $stage in
    suite|layers|offline|serve|kernels) "stage_$stage" ;;
    *) echo "unknown stage $stage (suite layers offline serve kernels)"; exit 2 ;;
  esac
done
cat "$RESULTS"
