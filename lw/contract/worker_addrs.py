"""Side-channel addresses of the P and D workers behind a proxy, learned from the traffic it
relays, so that ``lw status --proxy URL`` can ask them without a hand-written list.

A decode engine names its rank-0 side channel and TP size in every (signed) metaserver call; a
prefill engine names its workers in the ``kv_transfer_params`` of its prefill response. The proxy
keeps what it saw, bounded, and serves it on its control port (``GET /lw/workers``).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["PREFILL_ENGINE_KEY", "PREFILL_WORKERS_KEY", "KnownWorkers", "decode_workers",
           "worker_addrs"]

PREFILL_WORKERS_KEY = "lw_prefill_workers"
"""The key of a prefill response's ``kv_transfer_params`` that lists its workers."""
PREFILL_ENGINE_KEY = "lw_prefill_engine_id"
"""The key of a prefill response's ``kv_transfer_params`` that names its engine id."""

_ADDR = re.compile(r"^tcp://([A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):(\d{1,5})$")
MAX_PER_ROLE = 4096


def worker_addrs(host: str, first_port: int, tp_size: int) -> list[str]:
    """The side channels of one engine's TP ranks: rank j listens on ``first_port + j``."""
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return [f"tcp://{h}:{first_port + j}" for j in range(tp_size)]


def decode_workers(kv_params: Any) -> list[str]:
    """D's workers named by a metaserver call's ``kv_transfer_params`` ([] if malformed)."""
    if not isinstance(kv_params, dict):
        return []
    host, port, tp = (kv_params.get(k) for k in ("remote_host", "remote_port", "remote_tp_size"))
    if (not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool)
            or not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= 1024
            or not 0 < port <= 65536 - tp):  # its ranks listen on port .. port + tp - 1
        return []
    return [a for a in worker_addrs(host, port, tp) if _ADDR.match(a)]


class KnownWorkers:
    """Worker addresses per role ("prefill", "decode") in the order first seen, bounded."""

    def __init__(self, limit: int = MAX_PER_ROLE) -> None:
        self.limit = limit
        self._seen: dict[str, dict[str, None]] = {"prefill": {}, "decode": {}}

    def learn(self, role: str, addrs: Any) -> int:
        """Record the well-formed addresses in ``addrs`` (a list of ``tcp://HOST:PORT``); the
        number that were new. Anything else is ignored: the proxy serves traffic, not lists."""
        seen = self._seen[role]
        if not isinstance(addrs, list):
            return 0
        new = 0
        for a in addrs[:1024]:
            if (isinstance(a, str) and a not in seen and len(seen) < self.limit
                    and _ADDR.match(a) and 0 < int(a.rsplit(":", 1)[1]) < 65536):
                seen[a] = None
                new += 1
        return new

    def snapshot(self) -> dict[str, list[str]]:
        """Per role, the addresses seen."""
        return {role: list(seen) for role, seen in self._seen.items()}
