"""``lw proxy --sidecar``: the proxy as llm-d's decode-side routing sidecar.

In llm-d the inference scheduler (EPP) picks a decode pod and a prefill pod, sends the request to
the decode pod's sidecar and names the prefill pod in the header ``x-prefiller-host-port``
(``host:port``; several values, comma-separated or repeated, mean candidates: the first is used;
the older ``x-prefiller-url`` is read too). The sidecar runs lw's D-first round against its one
local decode server with the prefill on the named pod; without the header it falls back to its
own choice among ``--prefill`` servers, or, with none, lets the decode server compute the prompt
itself (as llm-d's sidecar does). A header names a prefill target only if the allowlist admits it:
the header comes from the network, and the sidecar would otherwise post prompts wherever a
client points it (SSRF).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from lw.vllm_adapter.proxy_state import Backend, normalize_url

__all__ = [
    "PREFILLER_HEADERS",
    "AllowEntry",
    "BadTarget",
    "Sidecar",
    "parse_allow",
    "prefiller_from_headers",
]

PREFILLER_HEADERS = ("x-prefiller-host-port", "x-prefiller-url")
"""Where llm-d's scheduler names the prefill pod: today's header first, then the older one."""

MAX_TARGETS = 256
"""Header-named prefill servers whose counters the sidecar keeps (least recently used go)."""


class BadTarget(ValueError):
    """A prefill target the sidecar will not use; ``status`` is the HTTP answer (400 malformed,
    403 not allowed)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _split(url: str) -> tuple[str, int]:
    """(host, port) of a base URL; raises ValueError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"scheme {parts.scheme!r} (http or https)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError("only host:port, no path, query or user")
    host = parts.hostname
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad port ({exc})") from None
    if not host or port is None:
        raise ValueError("host and port required (host:port)")
    return host, port


def prefiller_from_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]
                           ) -> str | None:
    """The prefill server a request names (its base URL), or None if it names none.

    Raises BadTarget (400) for a value that is not ``host:port`` (``http://`` may precede it)."""
    items = list(headers.items() if isinstance(headers, Mapping) else headers)
    for name in PREFILLER_HEADERS:
        values = [v for k, v in items if k.lower() == name]
        candidates = [c.strip() for v in values for c in v.split(",") if c.strip()]
        if not candidates:
            continue
        first = candidates[0]
        url = normalize_url(first)
        try:
            _split(url)
        except ValueError as exc:
            raise BadTarget(f"header {name}: {first[:200]!r} is not a prefill server "
                            f"address: {exc}", 400) from None
        return url
    return None


@dataclass(frozen=True)
class AllowEntry:
    """One allowlist entry: a host name, an address or a network, and optionally one port."""

    host: str = ""  # a name, compared as written (lower case)
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    port: int | None = None

    def admits(self, host: str, port: int) -> bool:
        """Whether ``host:port`` is inside this entry."""
        if self.port is not None and port != self.port:
            return False
        if self.network is not None:
            try:
                return ipaddress.ip_address(host) in self.network
            except ValueError:
                return False
        return host.lower() == self.host


def parse_allow(spec: str) -> AllowEntry:
    """``HOST``, ``HOST:PORT``, ``ADDRESS``, ``CIDR``, ``CIDR:PORT``, ``[V6]:PORT``,
    ``[V6CIDR]:PORT`` or a prefill server URL; raises ValueError saying what is wrong."""
    text = spec.strip()
    if "://" in text:
        try:
            host, port = _split(normalize_url(text))
        except ValueError as exc:
            raise ValueError(f"allowed prefiller {spec!r}: {exc}") from None
        return parse_allow(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    port: int | None = None
    if text.startswith("["):
        inner, _, rest = text[1:].partition("]")
        text = inner
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"allowed prefiller {spec!r}: expected ':PORT' after ']'")
            port = _port(spec, rest[1:])
    elif text.count(":") == 1:
        text, raw_port = text.split(":")
        port = _port(spec, raw_port)
    if not text:
        raise ValueError(f"allowed prefiller {spec!r}: no host")
    try:
        return AllowEntry(network=ipaddress.ip_network(text, strict=False), port=port)
    except ValueError:
        pass
    if "/" in text or not all(part and (part.isalnum() or "-" in part)
                              for part in text.split(".")):
        raise ValueError(f"allowed prefiller {spec!r}: {text!r} is neither a host name, an "
                         "address nor a network (CIDR)")
    return AllowEntry(host=text.lower(), port=port)


def _port(spec: str, raw: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"allowed prefiller {spec!r}: port {raw!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"allowed prefiller {spec!r}: port {port} out of range")
    return port


class Sidecar:
    """Which prefill server a request's header names, whether it may be used, and a Backend
    (with counters) per server named."""

    def __init__(self, allow: Iterable[AllowEntry], allow_any: bool = False) -> None:
        self.allow = tuple(allow)
        self.allow_any = allow_any
        self.backends: OrderedDict[str, Backend] = OrderedDict()

    def target(self, headers: Mapping[str, str] | Iterable[tuple[str, str]],
               known: Iterable[Backend] = ()) -> Backend | None:
        """The Backend a request's header names (None: no header); one of ``known`` (the
        proxy's own ``--prefill`` servers, always allowed) if it has that URL. Raises BadTarget:
        400 for a malformed value, 403 for a server the allowlist does not admit."""
        url = prefiller_from_headers(headers)
        if url is None:
            return None
        mine = next((b for b in known if b.url == url), None)
        if mine is not None:
            return mine
        host, port = _split(url)
        if not self.allow_any and not any(e.admits(host, port) for e in self.allow):
            raise BadTarget(f"prefill server {host}:{port} named by the request is not "
                            "allowed (lw proxy --allow-prefiller)", 403)
        backend = self.backends.get(url)
        if backend is None:
            backend = self.backends[url] = Backend(url, "prefill")
            while len(self.backends) > MAX_TARGETS:
                oldest = next(iter(self.backends))
                if self.backends[oldest].in_flight:
                    break  # counters of a running prefill stay; the cap is soft
                del self.backends[oldest]
        else:
            self.backends.move_to_end(url)
        return backend
