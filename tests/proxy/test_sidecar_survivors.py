"""The sidecar's prefill allowlist (lw.proxy.sidecar) where its other tests left a mutant alive:
what may follow a bracketed IPv6 host, a bracketed host that is no IPv6, the longest host name,
and the reason each malformed allowlist spec or header is refused with. Written to kill the
survivors of ``tools/mutation.py --scope security``; the forms and spellings are in
tests/vllm_adapter/test_edge_refusals.py and tests/proxy/test_allowlist_refusals.py."""

from __future__ import annotations

import pytest

from lw.proxy.sidecar import BadTarget, Sidecar, canonical_url, parse_allow

HEADER = "x-prefiller-host-port"
NAME_253 = ".".join(("a" * 63, "b" * 63, "c" * 63, "d" * 61))  # the longest DNS name
NAME_254 = NAME_253 + "d"


@pytest.mark.parametrize("allow_any", [False, True])
def test_a_bracketed_header_host_is_followed_by_a_colon_and_its_port(allow_any: bool) -> None:
    """``[fd00::5]x8000`` is malformed (400), even where ``[fd00::5]:8000`` is allowed."""
    sidecar = Sidecar([parse_allow("[fd00::5]:8000")], allow_any=allow_any)
    assert sidecar.target({HEADER: "[fd00::5]:8000"}) is not None
    with pytest.raises(BadTarget, match=r"host and port required \(\[v6\]:port\)") as err:
        sidecar.target({HEADER: "[fd00::5]x8000"})
    assert err.value.status == 400
    assert canonical_url("http://[fd00::5]x8000") is None


def test_an_allowlist_bracket_is_followed_by_a_colon_and_its_port_or_nothing() -> None:
    """``[fd00::5]x8000`` is no allowlist entry (the character after ``]`` is not skipped)."""
    assert parse_allow("[fd00::5]:8000").port == 8000
    with pytest.raises(ValueError, match=r"expected ':PORT' after '\]'"):
        parse_allow("[fd00::5]x8000")


def test_a_host_name_is_at_most_253_characters() -> None:
    """A 253-character name is read in an allowlist spec and a header; 254 is refused in both."""
    assert (len(NAME_253), len(NAME_254)) == (253, 254)
    assert parse_allow(f"{NAME_253}:8000").host == NAME_253
    backend = Sidecar([], allow_any=True).target({HEADER: f"{NAME_253}:8000"})
    assert backend is not None and backend.url == f"http://{NAME_253}:8000"
    with pytest.raises(ValueError, match="is neither a host name"):
        parse_allow(f"{NAME_254}:8000")
    with pytest.raises(BadTarget) as err:
        Sidecar([], allow_any=True).target({HEADER: f"{NAME_254}:8000"})
    assert err.value.status == 400 and "is neither a host name" in str(err.value)


@pytest.mark.parametrize(("spec", "why"), [
    (":8000", "no host"), ("[]:8000", "no host"),
    ("host/8", r"'host/8' is not a network \(CIDR\)"),
    ("pr\u00e9fill-0", "only printable ASCII without spaces"),
    ("10.0.\x0b0.7", "only printable ASCII without spaces"),
    ("10.0.0.7 :8000", "only printable ASCII without spaces"),
    ("a" * 300, "'a{80}' is neither a host name"),  # 300: not yet too long
    ("a" * 301, "longer than 300 characters"),
    ("user@prefill-0.ns.svc:8000", r"a user part \('...@'\) is not accepted"),
    ("@10.0.0.0/16", r"a user part \('...@'\) is not accepted"),
])
def test_an_allowlist_spec_is_refused_saying_what_is_wrong(spec: str, why: str) -> None:
    """The operator is told why a spec is no entry: each check's own reason."""
    with pytest.raises(ValueError, match=why):
        parse_allow(spec)


@pytest.mark.parametrize("allow_any", [False, True])
def test_a_bracketed_host_urlsplit_passes_but_ipv6_does_not_read_is_a_400(allow_any: bool
                                                                           ) -> None:
    """``[v1.fe80]`` (an IPvFuture literal, which urlsplit lets through) is refused 400 as no
    IPv6 address, in a header and as the sidecar's own server, never an exception."""
    with pytest.raises(BadTarget, match=r"\[v1\.fe80\] is not an IPv6 address") as err:
        Sidecar([parse_allow("fd00::/16")], allow_any=allow_any).target(
            {HEADER: "[v1.fe80]:8000"})
    assert err.value.status == 400
    assert canonical_url("http://[v1.fe80]:8000") is None


@pytest.mark.parametrize("value", ["10.0.0.7", ":8000", "prefill-0"])
def test_a_header_without_its_host_or_its_port_is_refused_saying_so(value: str) -> None:
    """A header missing the host or the ``:port`` is a 400 that says "host and port required"
    (not the reason a later check would find in what is left)."""
    with pytest.raises(BadTarget, match=r"host and port required \(host:port\)") as err:
        Sidecar([], allow_any=True).target({HEADER: value})
    assert err.value.status == 400
