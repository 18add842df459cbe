"""Start-up shim of ``benchmarks/d_step_trace.py`` (never used by lw itself): with
``LW_STEPTRACE`` set to a file, every Python process started with this folder on PYTHONPATH
appends a line per milestone of a request's path through the proxy, D and P.

Line: ``<monotonic s> <pid> <event> <id>``. The clock is the host's (CLOCK_MONOTONIC), so lines
of the proxy, the engine cores and the workers compare. Events: ``report_<Report>`` (the
worker loop queued a core report: D's RecvDone is its last DONE), ``w_results``/``w_recv``
(a worker step's end, where vLLM collects the reports, and each request it reports received),
``w_bind`` (a worker step's start, its connector metadata bound, before the forward),
``w_fwd_start``/``w_fwd_end`` (the forward's start and end, where the connector starts loading
and waits for its saves), ``w_sampled`` (the runner hands lw the step's sampled tokens),
``s_new``/``s_alloc``/``s_update_recv``/``s_sched`` (the scheduler took a new request,
allocated its blocks, learnt a receive finished, scheduled a request), ``d_meta_call`` (D's
metaserver thread starts a call: it has the GIL and the queued request), ``e_out`` / ``a_out``
(an engine core's step returned a request's new tokens; an API server began processing them),
``a_send`` (an lw engine's API server sent response body bytes), and the proxy's
``p_received``/``p_d_sent``/``p_meta_posted``/``p_p_sent``/``p_p_ahead_sent``/``p_p_done``/
``p_first_token``/``p_end`` (it read the client's request; its POST to D left; D's metaserver
call came; its POST to P left, D first or ahead; P answered; its first bytes of D's answer went
to the client; the answer ended), with ``p_sched_p_done``/``p_sched_first_token`` after the two
it times: the calling thread's CPU time and time waiting for a CPU, ``<ns>/<ns>``.
The modules are wrapped as they are imported (a finder on ``sys.meta_path``), so a process that
never imports one pays nothing for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_PATH = os.environ.get("LW_STEPTRACE")


def log(event: str, ident: str = "") -> None:
    """Append one milestone (a line written whole with O_APPEND: processes do not interleave)."""
    if _PATH:
        line = f"{time.monotonic():.6f} {os.getpid()} {event} {ident}\n".encode()
        fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _schedstat() -> str:
    """This thread's CPU time and time waiting for a CPU (ns, ``/proc/thread-self/schedstat``),
    as ``cpu/wait``: where a process's time went between two milestones."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu, wait, _ = f.read().split()
        return f"{cpu}/{wait}"
    except OSError:
        return ""


def _wrap(cls: type, name: str, before: Callable[..., None] | None = None,
          after: Callable[..., None] | None = None) -> None:
    original = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(self, *args, **kwargs)
        out = original(self, *args, **kwargs)
        if after is not None:
            after(self, out, *args, **kwargs)
        return out

    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def _connector(m: ModuleType) -> None:
    c = m.LwConnector

    def results(self: Any, out: Any, *a: Any, **k: Any) -> None:
        log("w_results")
        for rid in out.finished_recving or ():
            log("w_recv", rid)

    def update(self: Any, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            log("s_update_recv", rid)

    def scheduled(self: Any, scheduler_output: Any) -> None:
        for rid in getattr(scheduler_output, "num_scheduled_tokens", None) or {}:
            log("s_sched", rid)

    _wrap(c, "get_transfer_results", after=results)
    _wrap(c, "start_load_kv", before=lambda self, *a, **k: log("w_fwd_start"))
    _wrap(c, "wait_for_save", before=lambda self, *a, **k: log("w_fwd_end"))
    _wrap(c, "tokens_sampled", before=lambda self, *a, **k: log("w_sampled"))
    _wrap(c, "bind_connector_metadata", after=lambda self, out, *a, **k: log("w_bind"))
    _wrap(c, "update_connector_output", before=update)
    _wrap(c, "on_new_request", before=lambda self, r: log("s_new", r.request_id))
    _wrap(c, "update_state_after_alloc",
          after=lambda self, out, r, *a, **k: log("s_alloc", r.request_id))
    _wrap(c, "build_connector_meta", before=scheduled)


def _metaserver_client(m: ModuleType) -> None:
    _wrap(m.MetaserverPoster, "_call", before=lambda self, *a, **k: log("d_meta_call"))


def _runtime(m: ModuleType) -> None:
    _wrap(m.WorkerLoop, "report",
          after=lambda self, out, e: log("report_" + type(e).__name__, e.req_id))


def _proxy_timeline(m: ModuleType) -> None:
    def mark(self: Any, transfer_id: str, event: str, t: float | None = None) -> None:
        if event in ("received", "d_sent", "meta_posted", "p_sent", "p_ahead_sent", "p_done",
                     "first_token", "end"):
            log("p_" + event, transfer_id)
            if event in ("p_done", "first_token"):  # between them: did the proxy wait?
                log("p_sched_" + event, _schedstat())

    _wrap(m.ProxyTimeline, "mark", before=mark)


def _new_tokens(outputs: Any) -> list[str]:
    """Ids of the requests with new tokens in a list of vLLM ``EngineCoreOutput``."""
    return [o.request_id for o in outputs or () if getattr(o, "new_token_ids", None)]


def _engine_core(m: ModuleType) -> None:
    def stepped(self: Any, out: Any, *a: Any, **k: Any) -> None:
        for eco in (out[0] or {}).values() if out else ():
            for rid in _new_tokens(eco.outputs):
                log("e_out", rid)

    for name in ("step", "step_with_batch_queue"):
        if hasattr(m.EngineCore, name):
            _wrap(m.EngineCore, name, after=stepped)


def _output_processor(m: ModuleType) -> None:
    def processing(self: Any, outputs: Any, *a: Any, **k: Any) -> None:
        for rid in _new_tokens(outputs):
            log("a_out", rid)

    _wrap(m.OutputProcessor, "process_outputs", before=processing)


def _admission(m: ModuleType) -> None:
    original = m.TransferParamsGuard.__call__

    async def guarded(self: Any, scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: Any) -> None:
            if message.get("type") == "http.response.body" and message.get("body"):
                log("a_send")
            await send(message)

        await original(self, scope, receive, sending)

    m.TransferParamsGuard.__call__ = guarded


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "lw.vllm_adapter.admission": _admission,
    "vllm.v1.engine.core": _engine_core,
    "vllm.v1.engine.output_processor": _output_processor,
    "lw.vllm_adapter.connector": _connector,
    "lw.transport.runtime": _runtime,
    "lw.vllm_adapter.metaserver_client": _metaserver_client,
    "lw.proxy.timeline": _proxy_timeline,
}


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: runs a patch right after the module it is for has executed."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def patched_exec(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = patched_exec  # type: ignore[method-assign]
        return spec


if _PATH:
    sys.meta_path.insert(0, _Finder())
