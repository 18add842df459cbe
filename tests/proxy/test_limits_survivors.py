"""The proxy's bounds (lw.proxy.limits) where its other tests left a mutant alive: what a body
read says when its client leaves. Written to kill the survivors of ``tools/mutation.py --scope
security``; the bounds' edges are in tests/proxy/test_limits_refusals.py."""

from __future__ import annotations

import pytest

from lw.proxy.limits import BodyAbandoned
from tests.proxy.test_limits_refusals import read, request


def test_a_body_abandoned_says_how_many_bytes_arrived() -> None:
    """A client that leaves after 4 bytes: BodyAbandoned's message and size both say 4."""
    with pytest.raises(BodyAbandoned) as err:
        read(request([b"ab", b"cd"], gone=True), 10)
    assert str(err.value) == "the client disconnected after 4 bytes of its body"
    assert err.value.size == 4
