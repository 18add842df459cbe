"""Start-up shim for the benchmark's non-lw vLLM servers on CPU (never used by lw itself).

vLLM's MooncakeConnector worker calls ``torch.accelerator.current_device_index()`` at start-up,
which raises on a machine without an accelerator; here it returns 0 instead. On AMX machines the
process also asks the kernel for AMX tile permission, as lw's connector does, so that vLLM's CPU
attention (which uses AMX tiles for short queries over cached KV) cannot die with SIGILL.
"""

from __future__ import annotations


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
