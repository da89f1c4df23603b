#!/usr/bin/env bash
# Device driver: install the vLLM bundle and the project, then run one of:
#   bash benchmarks/gpu/run_gpu_e2e.sh gpu  [pytest args...]   # the GPU tier (see GPU_TESTS)
#   bash benchmarks/gpu/run_gpu_e2e.sh bench [gpu_e2e.py args...]   # vLLM direct vs. the service
#   bash benchmarks/gpu/run_gpu_e2e.sh sync  [weight_sync.py args...]  # weight-sync speed and memory
# through the device tool: run(command="bash benchmarks/gpu/run_gpu_e2e.sh gpu", carry=[".devbundle"])
# (bundle built per ../shared/gpu/README.md). TOTAL_LIMIT caps the whole call (default 585 s).
set -u
WHAT=${1:-gpu}; shift || true
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
bash .devbundle/tools/install-vllm-bundle.sh .devbundle /tmp/site || exit 90
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 ZMQ_ROLLOUT_ATTENTION_BACKEND=TRITON_ATTN
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/env.txt 2>&1 || { cat $OUT/env.txt; exit 91; }
{ echo "install done at $(el) s"; python3 --version; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv;
  python3 -c "import typer, prometheus_client, psutil, pytest, pytest_timeout, zmq, msgspec, torch, transformers; print('deps ok', torch.__version__, transformers.__version__, zmq.__version__, msgspec.__version__)";
  python3 -c "import vllm, zmq_rollout.workers.engine as e; print('vllm', vllm.__version__, e.__file__)"; } >> $OUT/env.txt 2>&1
tail -8 $OUT/env.txt
LEFT=$(( ${TOTAL_LIMIT:-585} - $(el) ))
case "$WHAT" in
  gpu)
    # The GPU tier: tests/gpu (CUDA only), and the integration tier's engine tests on the CUDA build.
    TESTS=${GPU_TESTS:-tests/gpu tests/integration/test_vllm_integration.py tests/integration/test_lora_sync.py}
    echo "=== GPU tier: $TESTS, limit $LEFT s"
    timeout $LEFT python3 -m pytest -q -s -p no:cacheprovider --durations=0 $TESTS "$@" > $OUT/gpu_tier.log 2>&1
    echo "=== GPU tier rc=$? at $(el) s"
    grep -E "cuda_ipc:|direct load:|adapter|greedy|passed|failed|skipped|Error|assert" $OUT/gpu_tier.log | tail -40
    tar czf $OUT/gpu_tier_logs.tgz -C /tmp --exclude='*.safetensors' pytest-of-root 2>/dev/null ;;
  bench)
    timeout $LEFT python3 benchmarks/gpu_e2e.py --json-out $OUT/bench.json --phase-timeout 220 "$@" > $OUT/bench.log 2>&1
    echo "=== bench rc=$? at $(el) s"
    cp ${WORK_DIR:-/tmp/gpu_e2e}/logs/worker-0.log $OUT/bench_worker.log 2>/dev/null
    cp ${WORK_DIR:-/tmp/gpu_e2e}/logs/profile-* $OUT/ 2>/dev/null  # --py-spy
    grep -E "^\[gpu_e2e|^  |^ *pair|^ratio|^GPU|^workload|RESULT|Error|Traceback" $OUT/bench.log | grep -v "^  File" | tail -40 ;;
  sync)
    # TAG names the outputs, so one call can run several (TAG=7b bash ... sync --shape 7b ...).
    W=/tmp/weight_sync${TAG:+-$TAG}; rm -rf $W; mkdir -p $W
    timeout $LEFT python3 benchmarks/weight_sync.py --json-out $OUT/weight_sync${TAG:+-$TAG}.json --phase-timeout $LEFT \
      --work-dir $W "$@" > $OUT/weight_sync${TAG:+-$TAG}.log 2>&1
    echo "=== weight_sync bench ${TAG:-} rc=$? at $(el) s"
    cp $W/worker-0.log $OUT/sync_worker${TAG:+-$TAG}.log 2>/dev/null
    grep -E "^\[weight_sync|^  |^model|Error|Traceback" $OUT/weight_sync${TAG:+-$TAG}.log | grep -v "^  File" | tail -40
    grep -E "this round on the worker|in the engine \(ms\)" $OUT/sync_worker${TAG:+-$TAG}.log 2>/dev/null | tail -4 ;;
  *) echo "unknown mode $WHAT (gpu, bench, sync)"; exit 2 ;;
esac
nvidia-smi --query-gpu=memory.used --format=csv,noheader
