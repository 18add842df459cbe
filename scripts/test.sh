#!/usr/bin/env bash
# The whole test suite: lint, generated docs up to date, then every test (unit, model checker,
# multi-process with real Mooncake, end-to-end on real vLLM engines).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# LW_STRICT_SKIPS=1: a skipped test fails the run (tests/conftest.py lists the expected skips).
export HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1 LW_STRICT_SKIPS=1
.venv/bin/ruff check lw tests benchmarks tools
.venv/bin/python -m lw diagrams --check
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
