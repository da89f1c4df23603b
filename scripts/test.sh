#!/usr/bin/env bash
# The tests, as CI runs them. Extra arguments go to pytest.
#
#   scripts/test.sh          install, lint, type-check, then every tier: unit, integration (real
#                            vLLM CPU workers, a real Prometheus), gpu (skipped without CUDA; run it
#                            on the device machine: benchmarks/gpu/run_gpu_e2e.sh gpu)
#   scripts/test.sh --fast   the unit tier only (no vLLM engine, no sleeps; under a minute):
#                            the edit loop
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
args=()
for arg in "$@"; do
    if [ "$arg" = "--fast" ]; then fast=1; else args+=("$arg"); fi
done

# Both tiers use a real Prometheus (Debian's package): the unit tier checks the alert rules and
# the dashboards' PromQL with promtool, the integration tier scrapes the broker with it.
need_prometheus() {
    if ! command -v prometheus >/dev/null 2>&1 && [ ! -x /usr/bin/prometheus ] && [ "${ZMQ_ROLLOUT_NO_PROMETHEUS:-0}" != 1 ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "installing prometheus (Debian package: prometheus, promtool) for the metrics tests"
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
        else
            echo "tests need the Prometheus binaries: run 'sudo apt-get install -y prometheus'," \
                 "or set ZMQ_ROLLOUT_NO_PROMETHEUS=1 to skip those tests deliberately" >&2
            exit 1
        fi
    fi
}

if [ "$fast" = 1 ]; then
    [ -x .venv/bin/python ] || scripts/install.sh
    need_prometheus
    .venv/bin/ruff check .
    exec .venv/bin/python -m pytest -q tests/unit "${args[@]}"
fi

scripts/install.sh
need_prometheus
.venv/bin/ruff check .
.venv/bin/ruff format --check zmq_rollout broker workers
.venv/bin/mypy zmq_rollout broker workers
.venv/bin/python -m pytest -q "${args[@]}"
