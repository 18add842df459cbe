"""Signed calls to the proxy's control plane: D signs each metaserver call, the proxy checks it.

A call carries three headers: a wall-clock timestamp, a random nonce and an HMAC-SHA256 of
``purpose, timestamp, nonce, body`` under the cluster key (the key of the P/D side channel). The
proxy accepts a call only if the MAC is right, the timestamp is within ``window_s`` of its own
clock, and the nonce was not seen in that window: a call cannot be forged without the key, nor
replayed, and the body (transfer, sub-transfer, grant, D's block ids) cannot be altered.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

__all__ = ["CallVerifier", "signed_call", "SIGNATURE", "TIMESTAMP", "NONCE"]

SIGNATURE = "x-lw-signature"
TIMESTAMP = "x-lw-timestamp"
NONCE = "x-lw-nonce"
_PURPOSE = b"lw-metaserver-call/1"
"""Domain separation: a MAC made for the side channel is never a valid control-plane MAC."""

# The headers' only accepted forms (ASCII by construction, so the MAC compare cannot raise): a
# lower-case hex SHA-256, a plain non-negative decimal (no nan/inf/exponent/sign) and a token.
_SIGNATURE_RE = re.compile(r"[0-9a-f]{64}")
_TIMESTAMP_RE = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?")
_NONCE_RE = re.compile(r"[0-9A-Za-z_-]{8,64}")
MAX_TIMESTAMP_CHARS = 22
"""Longest accepted timestamp (12 integer digits, a point, 9 decimals)."""


def _mac(key: bytes, ts: str, nonce: str, content: bytes) -> str:
    msg = b"\n".join((_PURPOSE, ts.encode(), nonce.encode(), content))
    return hmac.digest(key, msg, "sha256").hex()


def signed_call(key: bytes | None, body: Any, now: float | None = None,
                nonce: str | None = None) -> tuple[bytes, dict[str, str]]:
    """The bytes and headers of a POST of ``body`` (JSON), signed when there is a key."""
    content = json.dumps(body, separators=(",", ":")).encode()
    headers = {"content-type": "application/json"}
    if key is not None:
        ts = f"{time.time() if now is None else now:.3f}"
        nonce = nonce or os.urandom(16).hex()
        headers.update({TIMESTAMP: ts, NONCE: nonce, SIGNATURE: _mac(key, ts, nonce, content)})
    return content, headers


class CallVerifier:
    """The proxy's check of a signed call; ``key`` None accepts every call (trusted network)."""

    def __init__(self, key: bytes | None, window_s: float = 30.0,
                 max_nonces: int = 200_000) -> None:
        if not 0 < window_s < float("inf"):
            # nan compares false with every timestamp and inf accepts any: either one would
            # switch the staleness check off
            raise ValueError(f"signature window (window_s) must be > 0 s and finite, got "
                             f"{window_s}")
        self.key = key
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._seen: set[str] = set()
        self._expiry: deque[tuple[float, str]] = deque()  # (forget after, nonce), in order

    def header_problem(self, headers: Mapping[str, str]) -> str:
        """Why these headers cannot belong to an accepted call ("" if they may); needs no body,
        so a caller can refuse before reading one."""
        if self.key is None:
            return ""
        sig, ts, nonce = (headers.get(h) for h in (SIGNATURE, TIMESTAMP, NONCE))
        if not (isinstance(sig, str) and isinstance(ts, str) and isinstance(nonce, str)
                and sig and ts and nonce):
            return (f"unsigned call (headers {SIGNATURE}, {TIMESTAMP} and {NONCE} required): "
                    "the caller does not have the cluster key (kv_connector_extra_config."
                    "cluster_key or LW_CLUSTER_KEY on the decode server)")
        # Sizes first: nothing below looks at more than these few bytes of a hostile header.
        if len(sig) != 64:
            return f"{SIGNATURE} must have 64 characters (hex HMAC-SHA256), got {len(sig)}"
        if len(ts) > MAX_TIMESTAMP_CHARS:
            return f"{TIMESTAMP} must have at most {MAX_TIMESTAMP_CHARS} characters"
        if not 8 <= len(nonce) <= 64:
            return f"{NONCE} must have 8..64 characters"
        if not _SIGNATURE_RE.fullmatch(sig):
            return f"{SIGNATURE} is not lower-case hex"
        if not _TIMESTAMP_RE.fullmatch(ts):
            return (f"{TIMESTAMP} is not a number (plain decimal seconds since the epoch): "
                    f"{ts!r}")
        if not _NONCE_RE.fullmatch(nonce):
            return f"{NONCE} must be 8..64 characters of [0-9A-Za-z_-]"
        return ""

    def check(self, headers: Mapping[str, str], content: bytes, now: float | None = None
              ) -> str:
        """Why this call is refused ("" if it is accepted; then its nonce is spent)."""
        if self.key is None:
            return ""
        problem = self.header_problem(headers)
        if problem:
            return problem
        now = time.time() if now is None else now
        sig, ts, nonce = (str(headers.get(h)) for h in (SIGNATURE, TIMESTAMP, NONCE))
        sent = float(ts)  # finite: the pattern above admits digits and one point only
        if not hmac.compare_digest(sig, _mac(self.key, ts, nonce, content)):
            return "bad signature: the body was altered or signed with another key"
        if abs(now - sent) > self.window_s:
            return (f"stale call: signed {now - sent:+.1f} s from the proxy's clock, the window "
                    f"is +-{self.window_s:g} s (clocks out of sync, or a replay)")
        self._forget(now)
        if nonce in self._seen:
            return "replayed call: this nonce was already used"
        if len(self._seen) >= self.max_nonces:
            return f"more than {self.max_nonces} calls within {self.window_s:g} s; refused"
        self._seen.add(nonce)
        # A nonce is needed only while its timestamp is inside the window.
        self._expiry.append((sent + self.window_s, nonce))
        return ""

    def _forget(self, now: float) -> None:
        # Expiries arrive nearly in order (timestamps within the window): a few may stay a
        # little longer than needed, never shorter.
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(self._expiry.popleft()[1])
