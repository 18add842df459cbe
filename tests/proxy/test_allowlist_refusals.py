"""The sidecar's prefill allowlist (lw.proxy.sidecar) at its edges: which header-named servers it
keeps counters for, and what it refuses before any server is contacted. Written to kill the
survivors of ``tools/mutation.py --scope security``; the forms and spellings are tried in
tests/vllm_adapter/test_edge_refusals.py."""

from __future__ import annotations

import pytest

from lw.proxy.backend import Backend
from lw.proxy.sidecar import MAX_TARGETS, BadTarget, Sidecar, canonical_url, parse_allow

HEADER = "x-prefiller-host-port"


def named(i: int) -> dict[str, str]:
    """The header naming the i-th server of 10.1.0.0/16."""
    return {HEADER: f"10.1.{i // 250}.{i % 250 + 1}:8000"}


def test_the_sidecar_keeps_the_most_recently_named_servers_and_the_busy_ones() -> None:
    """At most 256 servers' counters (MAX_TARGETS's docstring): the least recently named go,
    unless a prefill is running on it (the cap is soft then)."""
    assert MAX_TARGETS == 256
    sidecar = Sidecar([parse_allow("10.0.0.0/8")])
    first = sidecar.target(named(0))
    assert first is not None and sidecar.target(named(0)) is first  # one backend per server
    for i in range(1, MAX_TARGETS):
        sidecar.target(named(i))
    assert sidecar.target(named(0)) is first  # named again: now the most recent
    sidecar.target(named(MAX_TARGETS))
    assert len(sidecar.backends) == MAX_TARGETS
    assert "http://10.1.0.1:8000" in sidecar.backends  # kept: named recently
    assert "http://10.1.0.2:8000" not in sidecar.backends  # the least recently named went
    oldest = sidecar.backends[next(iter(sidecar.backends))]
    oldest.in_flight = 1
    sidecar.target(named(MAX_TARGETS + 1))
    assert len(sidecar.backends) == MAX_TARGETS + 1 and oldest.url in sidecar.backends


def test_a_header_without_a_port_or_host_is_malformed_before_the_allowlist() -> None:
    sidecar = Sidecar([], allow_any=True)
    for value in ("10.0.0.7", "10.0.0.7:", ":8000", "[fd00::1]", "[fd00::1]8000",
                  "10.0.\t0.7:8000", "10.0.0.7:8000 x", "10.0.0.\u0667:8000"):
        with pytest.raises(BadTarget) as err:
            sidecar.target({HEADER: value})
        assert err.value.status == 400, value


def test_no_header_names_no_target_and_other_headers_are_not_read() -> None:
    sidecar = Sidecar([parse_allow("10.0.0.0/8")])
    assert sidecar.target({}) is None
    assert sidecar.target({"x-prefiller": "10.0.0.7:8000", "host": "10.0.0.7:8000"}) is None
    assert sidecar.target([(HEADER.upper(), "10.0.0.7:8000")]) is not None  # any case


def test_allow_any_admits_what_the_allowlist_would_not() -> None:
    with pytest.raises(BadTarget) as err:
        Sidecar([parse_allow("10.0.0.0/8")]).target({HEADER: "192.168.0.1:8000"})
    assert err.value.status == 403
    backend = Sidecar([], allow_any=True).target({HEADER: "192.168.0.1:8000"})
    assert backend is not None and backend.url == "http://192.168.0.1:8000"


@pytest.mark.parametrize("spec", [
    "x" * 301, "[10.0.0.1]:8000", "[10.0.0.0/8]", "10.0.0.0/33", "host/8", "[fd00::1]8000",
    "[::ffff:10.0.0.1]:8000", "::ffff:10.0.0.0/104", "::ffff:0:0/96", "fd00::1%eth0", "[fd00::1",
    "10.0.0.1:8000:1"])
def test_an_allowlist_spec_is_refused_naming_why(spec: str) -> None:
    with pytest.raises(ValueError, match="allowed prefiller"):
        parse_allow(spec)


@pytest.mark.parametrize(("spec", "host", "port"), [
    ("x" * 63 + ".example:8000", "x" * 63 + ".example", 8000),
    ("[fd00::1]", "fd00::1", None), ("[fd00::/64]:9", "fd00::", 9),
    ("::fffe:0:0/95", "::fffe:0:0", None), ("10.0.0.0/8:1", "10.0.0.0", 1),
])
def test_an_allowlist_spec_at_its_edge_is_read(spec: str, host: str, port: int | None) -> None:
    entry = parse_allow(spec)
    got = entry.host or str(entry.network.network_address)  # type: ignore[union-attr]
    assert (got, entry.port) == (host, port)


def test_a_name_is_never_inside_a_network() -> None:
    """Names are not resolved: a network entry answers False (not merely falsy) for one."""
    assert parse_allow("10.0.0.0/8").admits("prefill-0", 8000) is False
    assert parse_allow("10.0.0.0/8").admits("10.1.2.3", 8000) is True


def test_the_sidecars_own_server_is_known_by_its_canonical_url() -> None:
    own = Backend("http://Prefill-0:8000/", "prefill")  # as configured: not canonical
    assert canonical_url(own.url) == "http://prefill-0:8000"
    assert canonical_url("http://[FD00::1]:80") == "http://[fd00::1]:80"
    assert canonical_url("prefill-0") is None
    assert Sidecar([]).target({HEADER: "prefill-0:8000"}, [own]) is own  # no 403


def test_an_address_over_300_characters_is_refused_for_its_length() -> None:
    """The length is checked first and named; at 300 characters the host is what is wrong."""
    with pytest.raises(ValueError, match="longer than 300 characters"):
        parse_allow("a" * 301)
    sidecar = Sidecar([], allow_any=True)
    with pytest.raises(BadTarget, match="longer than 300 characters"):
        sidecar.target({HEADER: "http://" + "a" * 289 + ":8000"})
    with pytest.raises(BadTarget) as err:
        sidecar.target({HEADER: "http://" + "a" * 288 + ":8000"})  # 300 characters
    assert "longer than" not in str(err.value) and err.value.status == 400


def test_a_network_written_with_host_bits_is_read_as_its_network() -> None:
    entry = parse_allow("10.0.0.5/8")
    assert str(entry.network) == "10.0.0.0/8" and entry.admits("10.1.2.3", 80)
