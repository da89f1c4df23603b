#!/usr/bin/env bash
# Device driver: install bundle + project, then benchmark, then GPU integration tests.
# Usage (device tool, carry=[".devbundle"], bundle built per ../shared/gpu/README.md):
#   bash benchmarks/gpu/run_gpu_e2e.sh [bench|pytest|both] [extra bench args...]
#   bash benchmarks/gpu/run_gpu_e2e.sh sync [extra weight_sync.py args...]   # CUDA IPC test + weight-sync bench
set -u
WHAT=${1:-both}; shift || true
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
bash .devbundle/tools/install-vllm-bundle.sh .devbundle /tmp/site || exit 90
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 ZMQ_ROLLOUT_ATTENTION_BACKEND=TRITON_ATTN
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/env.txt 2>&1 || { cat $OUT/env.txt; exit 91; }
{ echo "install done at $(el) s"; python3 --version; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv;
  python3 -c "import typer, prometheus_client, psutil, pytest, pytest_timeout, zmq, msgspec, torch, transformers; print('deps ok', torch.__version__, transformers.__version__, zmq.__version__, msgspec.__version__)";
  python3 -c "import vllm, zmq_rollout.workers.engine as e; print('vllm', vllm.__version__, e.__file__)"; } >> $OUT/env.txt 2>&1
cat $OUT/env.txt | tail -8
if [ "$WHAT" = bench ] || [ "$WHAT" = both ]; then
  echo "=== bench start at $(el) s"
  timeout ${BENCH_LIMIT:-380} python3 benchmarks/gpu_e2e.py --json-out $OUT/bench.json --phase-timeout 220 "$@" > $OUT/bench.log 2>&1
  echo "=== bench rc=$? at $(el) s"
  cp ${WORK_DIR:-/tmp/gpu_e2e}/logs/worker-0.log $OUT/bench_worker.log 2>/dev/null
  grep -E "^\[gpu_e2e|^  |^GPU|^workload|RESULT|Error|Traceback" $OUT/bench.log | grep -v "^  File" | tail -40
fi
if [ "$WHAT" = pytest ] || [ "$WHAT" = both ]; then
  LEFT=$(( ${TOTAL_LIMIT:-585} - $(el) ))
  echo "=== pytest start at $(el) s, limit $LEFT s"
  timeout $LEFT python3 -m pytest -x -q -p no:cacheprovider --durations=0 tests/test_vllm_integration.py > $OUT/pytest.log 2>&1
  echo "=== pytest rc=$? at $(el) s"
  tail -40 $OUT/pytest.log
  tar czf $OUT/pytest_logs.tgz -C /tmp --exclude='*.safetensors' pytest-of-root 2>/dev/null
fi
if [ "$WHAT" = sync ]; then
  echo "=== cuda ipc pytest start at $(el) s"
  timeout ${SYNC_TEST_LIMIT:-200} python3 -m pytest -x -q -s -p no:cacheprovider ${SYNC_TESTS:-tests/test_cuda_ipc_gpu.py tests/test_lora_sync.py} > $OUT/sync_pytest.log 2>&1
  echo "=== cuda ipc pytest rc=$? at $(el) s"
  grep -E "cuda_ipc:|direct load:|adapter|passed|failed|Error|assert" $OUT/sync_pytest.log | tail -20
  LEFT=$(( ${TOTAL_LIMIT:-585} - $(el) ))
  echo "=== weight_sync bench start at $(el) s, limit $LEFT s"
  timeout $LEFT python3 benchmarks/weight_sync.py --json-out $OUT/weight_sync.json --phase-timeout $LEFT "$@" > $OUT/weight_sync.log 2>&1
  echo "=== weight_sync bench rc=$? at $(el) s"
  grep -E "^\[weight_sync|^  |^model|Error|Traceback" $OUT/weight_sync.log | grep -v "^  File" | tail -40
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader
