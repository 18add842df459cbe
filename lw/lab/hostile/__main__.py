"""``python -m lw.lab.hostile``: the same as ``lw hostile``."""

from __future__ import annotations

from lw.lab.hostile.run import main

if __name__ == "__main__":
    raise SystemExit(main())
