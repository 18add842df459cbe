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

Addresses are read strictly, in headers and allowlist specs alike (400 / ValueError otherwise):
``host:port`` or ``[v6]:port``, printable ASCII, no user part (not even an empty ``@host``), a
port of 1..65535 in plain decimal, a DNS name without trailing dot or a last label that is a
number (``10.1``, ``0x0a000001``: resolvers read those as addresses), no IPv6 zone id and no
IPv4-mapped IPv6 (IPv4 is written as IPv4). Names are never resolved: a name matches only a name
entry, an address only an address or network entry (tests/vllm_adapter/test_edge_refusals.py).
"""

from __future__ import annotations

import ipaddress
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from lw.proxy.backend import Backend
from lw.proxy.state import normalize_url

__all__ = [
    "PREFILLER_HEADERS",
    "AllowEntry",
    "BadTarget",
    "Sidecar",
    "canonical_url",
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


MAX_ADDRESS_CHARS = 300
"""Longest prefill server address read from a header or an allowlist spec (a DNS name has at
most 253 characters)."""

_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
_PORT = re.compile(r"[1-9][0-9]{0,4}")


def _name(text: str) -> str:
    """A DNS host name in lower case; raises ValueError saying why ``text`` is none.

    Refused: labels other than ``[a-z0-9-]`` (no ``_``, no trailing dot, no empty label) and a
    last label that is a number, which resolvers read as an address (``10.1``, ``0x0a000001``,
    ``167772161``, ``010.0.0.1``): an address must be written as one (dotted quad, or IPv6)."""
    name = text.lower()
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{text[:80]!r} is neither a host name, an address nor a network")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        raise ValueError(f"{text[:80]!r} is not an address lw reads (write IPv4 as a dotted "
                         "quad without leading zeros)")
    return name


def _address(text: str, bracketed: bool) -> str:
    """``text`` (a header's host) as lw compares it: an address in its canonical form, or a
    lower-case host name; raises ValueError."""
    if bracketed:
        if "%" in text:
            raise ValueError("an IPv6 zone id (%...) is not accepted")
        try:
            ip6 = ipaddress.IPv6Address(text)
        except ValueError:
            raise ValueError(f"[{text[:80]}] is not an IPv6 address") from None
        if ip6.ipv4_mapped is not None:
            # The allowlist compares IPv4 with IPv4: write the IPv4 form, never its v6 alias.
            raise ValueError(f"IPv4-mapped address [{ip6}]: write it as {ip6.ipv4_mapped}")
        return str(ip6)
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        return _name(text)


def _port_of(raw: str) -> int:
    """A TCP port written in plain decimal, 1..65535, without sign or leading zeros."""
    if not _PORT.fullmatch(raw) or int(raw) > 65535:
        raise ValueError(f"port {raw[:20]!r} is not 1..65535 in plain decimal")
    return int(raw)


def _split(url: str) -> tuple[str, int]:
    """(host, port) of a base URL, the host canonical (see :func:`_address`); raises ValueError
    naming what is wrong."""
    if len(url) > MAX_ADDRESS_CHARS:
        raise ValueError(f"longer than {MAX_ADDRESS_CHARS} characters")
    # urlsplit silently drops tabs and newlines and reads non-ASCII digits: refuse them first.
    if not url.isascii() or not url.isprintable() or " " in url:
        raise ValueError("only printable ASCII without spaces")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"scheme {parts.scheme!r} (http or https)")
    if "@" in parts.netloc:
        # Any user part, an empty one included ('@host', ':pw@host'): urlsplit's username is
        # '' there, and a server would still be reached with what precedes the '@'.
        raise ValueError("a user part ('...@') is not accepted")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("only host:port, no path, query or user")
    netloc = parts.netloc
    if netloc.startswith("["):
        inner, close, rest = netloc[1:].partition("]")
        if not close or not rest.startswith(":"):
            raise ValueError("host and port required ([v6]:port)")
        return _address(inner, bracketed=True), _port_of(rest[1:])
    host, colon, raw_port = netloc.partition(":")
    if not host or not colon:
        raise ValueError("host and port required (host:port)")
    return _address(host, bracketed=False), _port_of(raw_port)


def _url(scheme: str, host: str, port: int) -> str:
    """The canonical base URL of a prefill server (one Backend per server, however named)."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def canonical_url(url: str) -> str | None:
    """``url`` in the form the sidecar keys servers by, or None if it is no ``host:port``."""
    try:
        host, port = _split(url)
    except ValueError:
        return None
    return _url(urlsplit(url).scheme, host, port)


def prefiller_from_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]
                           ) -> str | None:
    """The prefill server a request names (its canonical base URL), or None if it names none.

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
            host, port = _split(url)
        except ValueError as exc:
            raise BadTarget(f"header {name}: {first[:200]!r} is not a prefill server "
                            f"address: {exc}", 400) from None
        return _url(urlsplit(url).scheme, host, port)
    return None


@dataclass(frozen=True)
class AllowEntry:
    """One allowlist entry: a host name, an address or a network, and optionally one port."""

    host: str = ""  # a name, compared as written (lower case)
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    port: int | None = None

    def admits(self, host: str, port: int) -> bool:
        """Whether ``host:port`` is inside this entry: its port (if it names one) and its host
        or network; a name never matches a network (names are not resolved) nor an address."""
        if self.port is not None and port != self.port:
            return False
        if self.network is not None:
            try:
                return ipaddress.ip_address(host) in self.network
            except ValueError:
                return False
        return bool(self.host) and host.lower() == self.host


def parse_allow(spec: str) -> AllowEntry:
    """``HOST``, ``HOST:PORT``, ``ADDRESS``, ``CIDR``, ``CIDR:PORT``, ``[V6]:PORT``,
    ``[V6CIDR]:PORT`` or a prefill server URL; raises ValueError saying what is wrong.

    An unbracketed IPv6 address takes no port (``fd00::5:8000`` is one address); a user part,
    a zone id and IPv4-mapped IPv6 (write the IPv4 form) are refused."""
    try:
        return _allow(spec.strip())
    except ValueError as exc:
        raise ValueError(f"allowed prefiller {spec[:200]!r}: {exc}") from None


def _allow(text: str) -> AllowEntry:
    """The entry ``text`` (stripped) names; raises ValueError saying why it names none."""
    if len(text) > MAX_ADDRESS_CHARS:
        raise ValueError(f"longer than {MAX_ADDRESS_CHARS} characters")
    if not text.isascii() or not text.isprintable() or " " in text:
        raise ValueError("only printable ASCII without spaces")
    if "@" in text:
        raise ValueError("a user part ('...@') is not accepted")
    if "://" in text:
        host, port = _split(normalize_url(text))
        try:
            return AllowEntry(network=ipaddress.ip_network(host), port=port)
        except ValueError:
            return AllowEntry(host=host, port=port)
    port: int | None = None
    bracketed = text.startswith("[")
    if bracketed:
        text, close, rest = text[1:].partition("]")
        if not close:
            raise ValueError("no ']' after '['")
        if rest:
            if not rest.startswith(":"):
                raise ValueError("expected ':PORT' after ']'")
            port = _port_of(rest[1:])
    elif text.count(":") == 1:
        text, raw_port = text.split(":")
        port = _port_of(raw_port)
    if not text:
        raise ValueError("no host")
    if "%" in text:
        raise ValueError("an IPv6 zone id (%...) is not accepted")
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        if bracketed:
            raise ValueError(f"[{text[:80]}] is not an IPv6 address or network") from None
        if "/" in text:
            raise ValueError(f"{text[:80]!r} is not a network (CIDR)") from None
        return AllowEntry(host=_name(text), port=port)
    if bracketed and network.version != 6:
        raise ValueError("brackets hold an IPv6 address or network")
    if (isinstance(network, ipaddress.IPv6Network) and network.prefixlen >= 96
            and network.network_address.ipv4_mapped is not None):
        raise ValueError(f"IPv4-mapped network {network}: write the IPv4 form")
    return AllowEntry(network=network, port=port)


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
        mine = next((b for b in known if url in (b.url, canonical_url(b.url))), None)
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
