#!/usr/bin/env bash
# Run THERE (the GPU machine, through the device tool), after benchmarks/gpu/prepare.sh here:
#
#   run(command="bash benchmarks/gpu/run.sh gpu_tests serve offline kernels", carry=[".whl", ".gpu"], timeout_s=600)
#
# Installs the carried wheels and aserve (no network there), writes random-weight 1B/8B Llama folders,
# then runs the stages named, in order (each bounded so a call stays inside the tool's 10 minutes; split
# stages over calls as the device time allows). Writes $OUT/results.md and $OUT/logs.tgz (every stage's
# log, re-packed after each stage so a call cut short still returns what it did; the tool returns at most
# 8 files):
#   gpu_tests  the `gpu`-marked tests (CUDA graphs, memory accounting, the Triton layer kernels inside the
#              served model, quantized checkpoints on the CUDA forms) and the kernel / layer / attention
#              tests on CUDA tensors
#   gpu_marked the first part of gpu_tests alone (the `gpu`-marked tests that share the card)
#   suite      the whole test suite on CUDA (tests needing the bundled model skip: it is not carried)
#   offline    1B offline throughput, 128 prompts x 512 in / 256 out (`aserve bench throughput`)
#   offline_backends  the same offline run with --distributed-executor-backend uni, then mp
#   serve      8B server (dummy weights): time to ready, c=1 ITL (16 prompts), c=128 (300 in / 256 out)
#   kernels    benchmarks/kernels.py (decode and prefill attention vs SDPA, every shape)
#   profile    the offline and serve stages' workloads under py-spy (carry its wheel in .whl: prepare.sh
#              fetches it): $OUT/prof_*.txt, collapsed stacks of the offline run and of the 8B server's
#              processes during c=1 and c=128 (read them with benchmarks/gpu/collapsed.py)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOGS=/tmp/aserve-gpu-logs; mkdir -p "$LOGS"
RESULTS=$OUT/results.md
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site ASERVE_LOG_LEVEL=${ASERVE_LOG_LEVEL:-INFO}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed" | tee -a "$RESULTS"; exit 1; }
mkdir -p /tmp/site/bin; python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . \
  || { echo "aserve install failed" | tee -a "$RESULTS"; exit 1; }
export PATH=/tmp/site/bin:$PATH
# pip --target leaves a wheel's data scripts out: py-spy (a binary in py_spy-*.data/scripts) is unzipped by hand
for w in .whl/py_spy-*.whl; do
  [[ -e $w ]] && python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = [m for m in z.namelist() if m.endswith('/scripts/py-spy')][0]; open('/tmp/site/bin/py-spy', 'wb').write(z.read(n))" "$w" \
    && chmod +x /tmp/site/bin/py-spy
done
python3 benchmarks/gpu/make_models.py /tmp/models > /dev/null
{ echo "# aserve on $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader), $(date -u +%F)";
  python3 -c "import torch, triton, transformers; print(f'torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}')"
  python3 -c "
import torch
from triton.testing import do_bench
x = torch.empty(2**30, dtype=torch.float32, device='cuda'); y = torch.empty_like(x)
ms = do_bench(lambda: y.copy_(x))
print(f'device copy: {2 * x.numel() * 4 / (ms * 1e-3) / 1e12:.2f} TB/s (read + write of 4 GiB each way)')"; } >> "$RESULTS"

pack_logs() { tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2> /dev/null; }

stage_gpu_marked() {
  # GPU_TESTS: the test paths to collect from (default: all of tests/)
  timeout 150 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -n 8 --timeout 120 -rfE -m "gpu and not gpu_alone" ${GPU_TESTS:-tests} \
    > "$LOGS/gpu_marked.log" 2>&1
  echo "- gpu-marked tests (exit $?): $(tail -1 "$LOGS/gpu_marked.log")" >> "$RESULTS"
}
stage_gpu_tests() {
  stage_gpu_marked
  timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 --timeout 100 -rfE -m gpu_alone tests \
    > "$LOGS/gpu_alone.log" 2>&1
  echo "- gpu tests that need the card alone (exit $?): $(tail -1 "$LOGS/gpu_alone.log")" >> "$RESULTS"
  timeout 120 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -n 8 --timeout 100 -rfE tests/kernels tests/model/layers \
    tests/model/attention > "$LOGS/kernel_tests.log" 2>&1
  echo "- kernel, layer and attention tests on CUDA (exit $?): $(tail -1 "$LOGS/kernel_tests.log")" >> "$RESULTS"
}
stage_suite() {
  timeout ${SUITE_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -n 8 --timeout 300 -rfE -m "not gpu_alone" tests > "$LOGS/suite.log" 2>&1
  echo "- suite (exit $?): $(tail -1 "$LOGS/suite.log")" >> "$RESULTS"
}
stage_offline() {
  local spy=()
  [[ -n ${PROFILE:-} ]] && spy=(py-spy record --nonblocking --rate 250 --format raw -o "$OUT/prof_offline.txt" --)
  timeout 150 "${spy[@]}" aserve bench throughput --model /tmp/models/1b --load-format dummy --dtype bfloat16 \
    --input-len 512 --output-len 256 --num-prompts 128 --output-json "$OUT/offline_1b.json" > "$LOGS/offline.log" 2>&1
  echo "- 1B offline (exit $?): $(grep -i 'throughput' "$LOGS/offline.log" | tail -2 | tr '\n' ' ')" >> "$RESULTS"
}
stage_offline_backends() {  # the 1B offline run with the runner in this process (uni) and in a worker process (mp)
  local backend
  for backend in uni mp; do
    timeout 90 aserve bench throughput --model /tmp/models/1b --load-format dummy --dtype bfloat16 --input-len 512 \
      --output-len 256 --num-prompts 128 --distributed-executor-backend $backend --output-json "$OUT/offline_$backend.json" \
      > "$LOGS/offline_$backend.log" 2>&1
    echo "- 1B offline, $backend executor (exit $?): $(grep -i 'throughput' "$LOGS/offline_$backend.log" | tail -1)" >> "$RESULTS"
  done
}
stage_serve() {
  local start ready port=8011
  start=$(date +%s.%N)
  aserve --model /tmp/models/8b --load-format dummy --dtype bfloat16 --port $port --disable-log-requests \
    > "$LOGS/server_8b.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    sleep 0.5
    if (( $(date +%s) - ${start%.*} > 180 )); then echo "- 8B server not ready after 180 s" >> "$RESULTS"; kill $pid; return; fi
    kill -0 $pid 2> /dev/null || { echo "- 8B server died: $(tail -3 "$LOGS/server_8b.log")" >> "$RESULTS"; return; }
  done
  ready=$(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')")
  echo "- 8B dummy ready after ${ready} s" >> "$RESULTS"
  [[ -n ${PROFILE:-} ]] && py-spy record --nonblocking --subprocesses --rate 250 --format raw --duration 12 \
    --pid $pid -o "$OUT/prof_c1.txt" > "$LOGS/spy_c1.log" 2>&1 &
  local spy_pid=$!
  timeout 90 aserve bench serve --base-url "http://127.0.0.1:$port" --tokenizer /tmp/models/8b --num-prompts 16 \
    --max-concurrency 1 --random-input-len 128 --random-output-len 128 --ignore-eos --disable-tqdm \
    > "$LOGS/serve_c1.log" 2>&1
  echo "- 8B c=1: $(grep -iE 'ITL|output token throughput' "$LOGS/serve_c1.log" | tr -s ' ' | tr '\n' ';')" >> "$RESULTS"
  [[ -n ${PROFILE:-} ]] && { wait $spy_pid; py-spy record --nonblocking --subprocesses --rate 250 --format raw --duration 15 \
    --pid $pid -o "$OUT/prof_c128.txt" > "$LOGS/spy_c128.log" 2>&1 & }
  timeout 150 aserve bench serve --base-url "http://127.0.0.1:$port" --tokenizer /tmp/models/8b --num-prompts 384 \
    --max-concurrency 128 --random-input-len 300 --random-output-len 256 --ignore-eos --disable-tqdm \
    > "$LOGS/serve_c128.log" 2>&1
  echo "- 8B c=128: $(grep -iE 'TTFT|output token throughput' "$LOGS/serve_c128.log" | tr -s ' ' | tr '\n' ';')" >> "$RESULTS"
  kill $pid; timeout 20 tail --pid=$pid -f /dev/null; kill -9 $pid 2> /dev/null
}
stage_profile() {
  command -v py-spy > /dev/null || { echo "- profile: py-spy not installed (prepare.sh fetches it)" >> "$RESULTS"; return; }
  PROFILE=1 stage_offline
  PROFILE=1 stage_serve
}
stage_kernels() {
  timeout 150 python3 benchmarks/kernels.py > "$LOGS/kernels.md" 2>&1
  echo "- kernels (exit $?): see kernels.md" >> "$RESULTS"
}

for stage in "$@"; do
  case $stage in
    gpu_tests|gpu_marked|suite|offline|offline_backends|serve|kernels|profile) s0=$SECONDS; "stage_$stage"; echo "  ($stage: $((SECONDS - s0)) s)" >> "$RESULTS"; pack_logs ;;
    *) echo "unknown stage $stage (gpu_tests gpu_marked suite offline offline_backends serve kernels profile)"; exit 2 ;;
  esac
done
cat "$RESULTS"
