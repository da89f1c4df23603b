#!/usr/bin/env bash
# The whole test suite, as CI runs it: install, lint, type-check, then every test
# (unit, broker, and integration with real vLLM CPU workers). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check zmq_rollout broker workers
.venv/bin/mypy zmq_rollout broker workers
.venv/bin/python -m pytest -q "$@"
