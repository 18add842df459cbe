#!/usr/bin/env bash
# lw's main job: a local P/D cluster (proxy + prefill + decode) on a tiny model, with a report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m lw demo "$@"
