"""What the end-to-end modules share: one reference engine per tiny-model kind for the whole
session. Every module's cluster of that kind compares its outputs with it (the model is the
same: make_tiny_model is deterministic from its spec), so each module starts one engine less
on two cores; the first cluster that asks starts it beside its own engines. Each later module
gets it with an empty prefix cache, as a reference of its own would be: modules reuse prompt
seeds (make_prompt's prompts of one seed share a prefix), and a reference answering from
another module's cached blocks is not the cold prefill the oracles compare with."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from lw.lab.local_cluster import LocalCluster, Server, wait_ready
from lw.lab.tiny_model import make_tiny_model


def _reset_prefix_cache(server: Server, timeout: float = 60.0) -> None:
    """Empty the engine's prefix cache (vLLM's dev endpoint; it refuses while blocks are held,
    e.g. by a request an earlier module left running: retried until ``timeout``)."""
    import httpx

    wait_ready([server], timeout)
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(server.url + "/reset_prefix_cache", timeout=timeout)
        r.raise_for_status()
        if r.json().get("success"):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"reference engine kept its prefix cache for {timeout:.0f} s")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def shared_reference(tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[Callable[[str], Server]]:
    """``shared_reference(kind)``: the session's reference engine of the default tiny model of
    ``kind`` ("llama" or "mla"), spawned on first use (not waited for: the cluster given it
    waits with its own engines), its prefix cache emptied on each later use, stopped at the
    end of the session."""
    started: dict[str, Server] = {}

    def get(kind: str) -> Server:
        if kind in started:
            _reset_prefix_cache(started[kind])
            return started[kind]
        work = tmp_path_factory.mktemp(f"reference-{kind}")
        model = make_tiny_model(work / "model", kind=kind)
        (work / "logs").mkdir()
        server = LocalCluster(model=model, workdir=work / "logs").reference_engine()
        server.env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache, on loopback only
        server.start()
        started[kind] = server
        return server

    try:
        yield get
    finally:
        for server in started.values():
            server.stop()
