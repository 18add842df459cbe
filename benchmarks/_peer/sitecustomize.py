"""Start-up shim for the benchmark's non-lw vLLM servers on CPU (never used by lw itself).

vLLM's MooncakeConnector worker calls ``torch.accelerator.current_device_index()`` at start-up,
which raises on a machine without an accelerator; here it returns 0 instead. On AMX machines the
process also asks the kernel for AMX tile permission, as lw's connector does, so that vLLM's CPU
attention (which uses AMX tiles for short queries over cached KV) cannot die with SIGILL.
vLLM's NIXL connectors import ``nixl`` (``nixl._api``), the name only the ``nixl`` meta package
provides, and that package needs both the CUDA 12 and 13 wheels; where only ``nixl-cu12`` is
installed, ``nixl`` and its submodules resolve to ``nixl_cu12``'s, imported when first asked
for (vLLM sets UCX's environment before that import).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

ALIASED = "nixl"
WHEEL = "nixl_cu12"


class _AliasLoader(importlib.abc.Loader):
    """Hands back ``nixl_cu12``'s module for a ``nixl`` name (imported on first use)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing: the target module ran when it was imported."""


class _NixlAlias(importlib.abc.MetaPathFinder):
    """Resolves ``nixl`` and ``nixl.*`` to ``nixl_cu12`` and ``nixl_cu12.*``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != ALIASED and not fullname.startswith(ALIASED + "."):
            return None
        real = WHEEL + fullname[len(ALIASED):]
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real),
                                               is_package=fullname == ALIASED)


def _alias_nixl() -> None:
    """Install the alias when ``nixl`` is missing and ``nixl_cu12`` is there."""
    try:
        if importlib.util.find_spec(ALIASED) is not None:
            return
        if importlib.util.find_spec(WHEEL) is None:
            return
    except (ImportError, ValueError):
        return
    sys.meta_path.insert(0, _NixlAlias())  # before the path finder, which would load it twice


def _install() -> None:
    """Patch torch once, in every Python process started with this folder on PYTHONPATH."""
    try:
        import torch
    except ImportError:
        return
    acc = getattr(torch, "accelerator", None)
    original = getattr(acc, "current_device_index", None)
    if original is not None and not getattr(original, "_lw_bench_shim", False):

        def current_device_index() -> int:
            try:
                return int(original())
            except RuntimeError:  # "Cannot access accelerator device when none is available"
                return 0

        current_device_index._lw_bench_shim = True  # type: ignore[attr-defined]
        acc.current_device_index = current_device_index  # type: ignore[union-attr]
    cpu = getattr(torch, "cpu", None)
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        init = getattr(cpu, "_init_amx", None)
        if init is not None:
            init()


_install()
_alias_nixl()
