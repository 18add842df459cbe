"""``python -m lw.vllm_adapter.hostile``: the same as ``lw hostile``."""

from __future__ import annotations

from lw.vllm_adapter.hostile.run import main

if __name__ == "__main__":
    raise SystemExit(main())
