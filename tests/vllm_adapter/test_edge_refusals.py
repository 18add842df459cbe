"""The sidecar's allowlist refused as an attacker would try it: for every entry form (host,
host:port, address, CIDR, CIDR:port, ``[v6]:port``, IPv6 CIDR, URL), the addresses it must admit
and, above all, those it must not (another port, a host outside the network, a name against an
address, a name whose prefix or suffix matches, IPv4-mapped IPv6, odd spellings of ports and
addresses, user parts), through ``Sidecar.target`` as a request's header reaches it.

Decisions (also in lw.proxy.sidecar):

* Names are never resolved: a name matches only a name entry, letter for letter (case aside); an
  address matches only an address or network entry.
* IPv4-mapped IPv6 (``[::ffff:10.0.0.1]``) is refused as malformed (400) in a header and in the
  allowlist: IPv4 is written as IPv4, so an IPv4 entry is never reached through its v6 alias and
  an IPv6 network (``::/0``) never admits an IPv4 host.
* A trailing-dot name (``p.ns.svc.``) is refused (400): under Kubernetes' search domains ``p.``
  and ``p`` can be different hosts. So are names whose last label is a number (``10.1``,
  ``0x0a000001``, ``167772161``, ``010.0.0.1``), which resolvers read as addresses.
* A port is 1..65535 in plain decimal: ``0``, ``65536``, ``08000``, ``+8000`` and non-ASCII
  digits are 400, whatever the allowlist.
* An IPv6 zone id (``[fe80::1%eth0]``) is refused: it would let the header choose the interface.
"""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lw.proxy.backend import Backend
from lw.proxy.sidecar import (
    MAX_TARGETS,
    AllowEntry,
    BadTarget,
    Sidecar,
    parse_allow,
)

HEADER = "x-prefiller-host-port"
ADMIT = 200  # the outcome of a header the allowlist admits


def outcome(specs: list[str], value: str, allow_any: bool = False) -> int:
    """ADMIT, or the HTTP status the sidecar refuses the header ``value`` with."""
    try:
        backend = Sidecar([parse_allow(s) for s in specs], allow_any=allow_any).target(
            {HEADER: value})
    except BadTarget as exc:
        return exc.status
    assert backend is not None
    return ADMIT


# (allowlist spec, header values it admits, values it refuses with 403, values refused as 400)
NAME = "prefill-0.ns.svc"
FORMS: list[tuple[str, list[str], list[str], list[str]]] = [
    (NAME,  # a host: any port
     [f"{NAME}:8000", f"{NAME}:1", f"{NAME}:65535", "PREFILL-0.NS.SVC:8000",
      f"http://{NAME}:8000", f"https://{NAME}:8000/", f"{NAME}:8000/v1"],
     ["prefill-1.ns.svc:8000", f"{NAME}.evil.example:8000", f"x{NAME}:8000",
      "prefill-0.ns:8000", "prefill-0:8000", "10.0.0.1:8000", "[fd00::1]:8000"],
     [f"{NAME}.:8000", f"{NAME}", f"{NAME}:0", f"{NAME}:65536", f"{NAME}:08000",
      f"{NAME}:+8000", f"{NAME}:8000 8001", f"{NAME}:\u0668\u0660\u0660\u0660",
      "prefill_0.ns.svc:8000", f"@{NAME}:8000", f":pw@{NAME}:8000", f"user@{NAME}:8000",
      f"http://@{NAME}:8000", f"{NAME}\x0b:8000", f"{NAME}\x00:8000", "pr\u00e9fill-0:8000"]),
    (f"{NAME}:8000",  # a host and a port
     [f"{NAME}:8000", "Prefill-0.Ns.Svc:8000"],
     [f"{NAME}:8001", f"{NAME}:800", f"{NAME}:80", f"{NAME}:18000", f"{NAME}:7999",
      "prefill-1.ns.svc:8000", f"{NAME}.evil.example:8000", "10.0.0.1:8000"],
     [f"{NAME}:08000", f"{NAME}:8000.0", f"{NAME}:0", f"{NAME}:65536", f"user@{NAME}:8000"]),
    ("10.0.0.7",  # an address: any port
     ["10.0.0.7:8000", "10.0.0.7:1", "http://10.0.0.7:65535"],
     ["10.0.0.70:8000", "10.0.0.8:8000", "110.0.0.7:8000", "10.0.0.6:8000",
      "[::10.0.0.7]:8000", "localhost:8000", "10-0-0-7.ns.svc:8000", "[fd00::7]:8000"],
     ["010.0.0.7:8000", "10.0.7:8000", "0x0a000007:8000", "167772167:8000",
      "10.0.0.7.:8000", "0x0a.0.0.7:8000", "[::ffff:10.0.0.7]:8000", "[::ffff:a00:7]:8000",
      "[10.0.0.7]:8000", "@10.0.0.7:8000", "10.0.0.7:0"]),
    ("10.0.0.7:8000",  # an address and a port
     ["10.0.0.7:8000"],
     ["10.0.0.7:8001", "10.0.0.8:8000", "10.0.0.70:8000", "10.0.0.7:80"],
     ["10.0.0.7:08000", "[::ffff:10.0.0.7]:8000", ":pw@10.0.0.7:8000"]),
    ("10.0.0.0/16",  # a network: any port
     ["10.0.0.1:9", "10.0.255.255:9", "10.0.0.0:9"],
     ["10.1.0.0:9", "11.0.0.1:9", "9.255.255.255:9", "10.00.0.1.example:9", "prefill:9",
      "[fd00::1]:9"],
     ["[::ffff:10.0.0.1]:9", "10.0.1:9", "10.0.0.1:0"]),
    ("10.0.0.0/16:8000",  # a network and a port
     ["10.0.3.4:8000"],
     ["10.0.3.4:8001", "10.1.3.4:8000", "10.1.3.4:8001", "10.0.3.4:80"],
     ["10.0.3.4:08000", "[::ffff:10.0.3.4]:8000"]),
    ("[fd00::5]:8000",  # an IPv6 address and a port
     ["[fd00::5]:8000", "[FD00::5]:8000", "[fd00:0:0:0:0:0:0:5]:8000", "http://[fd00::5]:8000"],
     ["[fd00::5]:8001", "[fd00::6]:8000", "[fd00::50]:8000", "[fd00::5:0]:8000",
      "10.0.0.5:8000"],
     ["fd00::5:8000", "[fd00::5%eth0]:8000", "[fd00::5%25eth0]:8000", "[fd00::5]",
      "[fd00::5]:08000", "@[fd00::5]:8000", "[fd00::5]8000"]),
    ("fd00::5",  # an IPv6 address (unbracketed: no port)
     ["[fd00::5]:8000", "[fd00::5]:1"],
     ["[fd00::6]:8000"],
     ["[fd00::5]:0"]),
    ("[fd00::/64]:8000",  # an IPv6 network and a port
     ["[fd00::9]:8000", "[fd00::ffff:ffff:ffff:ffff]:8000"],
     ["[fd00:0:0:1::9]:8000", "[fd00::9]:8001", "[fe80::9]:8000", "[fd01::9]:8000",
      "10.0.0.9:8000"],
     ["[fe80::9%1]:8000"]),
    ("fd00::/64",  # an IPv6 network: any port
     ["[fd00::9]:8000", "[fd00::9]:1"],
     ["[fd00:0:0:1::9]:8000", "[::fd00:9]:8000", "[::]:8000"],
     []),
    ("http://10.0.0.7:8000",  # a URL: its address and port
     ["10.0.0.7:8000", "http://10.0.0.7:8000"],
     ["10.0.0.7:8001", "10.0.0.8:8000"],
     []),
]


@pytest.mark.parametrize("spec,admit,forbid,malformed", FORMS, ids=[f[0] for f in FORMS])
def test_each_allowlist_form_admits_its_servers_and_refuses_the_rest(
        spec: str, admit: list[str], forbid: list[str], malformed: list[str]) -> None:
    for value in admit:
        assert outcome([spec], value) == ADMIT, (spec, value)
    for value in forbid:
        assert outcome([spec], value) == 403, (spec, value)
    for value in malformed:
        assert outcome([spec], value) == 400, (spec, value)
        assert outcome([spec], value, allow_any=True) == 400, (spec, value)


@pytest.mark.parametrize("spec", [
    # every form with a user part, an empty one included
    "@prefill-0.ns.svc", "@prefill-0.ns.svc:8000", ":pw@prefill-0.ns.svc:8000",
    "user@prefill-0.ns.svc:8000", "user:pw@prefill-0.ns.svc", "http://@prefill-0.ns.svc:8000",
    "http://:pw@prefill-0.ns.svc:8000", "https://user@prefill-0.ns.svc:8000",
    "@10.0.0.7", "@10.0.0.7:8000", "@10.0.0.0/16", "@10.0.0.0/16:8000", "[@fd00::5]:8000",
    "@[fd00::5]:8000", "@fd00::/64", "[@fd00::/64]:8000", "http://@[fd00::5]:8000",
    # IPv4-mapped IPv6: write the IPv4 form
    "::ffff:10.0.0.7", "[::ffff:10.0.0.7]:8000", "[::ffff:10.0.0.0/104]:8000",
    "http://[::ffff:10.0.0.7]:8000",
    # zone ids, odd ports, addresses that are not what they look like, brackets around IPv4
    "[fe80::1%eth0]:8000", "fe80::/10%eth0", "host:0", "host:65536", "host:08000",
    "host:+8000", "host:\u0668\u0660\u0660\u0660", "host: 8000", "10.0.0.0/16:0",
    "[fd00::5]:65536", "010.0.0.7", "10.0.7", "0x0a000007", "167772167", "host.",
    "prefill_0.ns.svc", "[10.0.0.7]:8000", "[prefill-0]:8000", "[fd00::5", "h" * 400,
])
def test_an_allowlist_spec_that_is_no_clear_address_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="allowed prefiller"):
        parse_allow(spec)


@pytest.mark.parametrize("spec,port", [("10.0.0.7:8000", 8000), ("10.0.0.0/16:8000", 8000),
                                       ("prefill-0.ns.svc:8000", 8000),
                                       ("[fd00::5]:8000", 8000), ("[fd00::/64]:8000", 8000),
                                       ("http://10.0.0.7:8000", 8000),
                                       ("http://prefill-0.ns.svc:8000", 8000),
                                       ("http://[fd00::5]:8000", 8000)])
def test_every_form_that_names_a_port_keeps_it(spec: str, port: int) -> None:
    """Each part of an entry matters on its own: the port (whatever form it is written in) and
    the host, so a parser or matcher that drops either is caught."""
    entry = parse_allow(spec)
    assert entry.port == port
    host = str(entry.network.network_address) if entry.network is not None else entry.host
    if entry.network is not None and entry.network.num_addresses > 1:
        host = str(entry.network.network_address + 1)
    assert entry.admits(host, port)
    assert not entry.admits(host, port + 1)  # the host alone is not enough
    other = "prefill-9.other" if entry.network is None else str(
        entry.network.broadcast_address + 1)
    assert not entry.admits(other, port)  # nor the port alone
    assert not entry.admits(other, port + 1)


@pytest.mark.parametrize("entry", [
    AllowEntry(host="prefill-0", port=8000),
    AllowEntry(network=ipaddress.ip_network("10.0.0.0/24"), port=8000),
    AllowEntry(network=ipaddress.ip_network("fd00::/64"), port=8000),
])
def test_admits_needs_both_the_host_and_the_port(entry: AllowEntry) -> None:
    host = entry.host or str(entry.network.network_address + 1)  # type: ignore[union-attr]
    elsewhere = "prefill-1" if entry.host else str(
        entry.network.broadcast_address + 1)  # type: ignore[union-attr]
    assert entry.admits(host, 8000)
    assert [entry.admits(host, 8001), entry.admits(elsewhere, 8000),
            entry.admits(elsewhere, 8001)] == [False, False, False]
    assert not AllowEntry().admits("", 8000)  # an empty entry admits nothing


def test_entries_do_not_combine_one_entrys_host_with_anothers_port() -> None:
    specs = ["10.0.0.7:8000", "10.0.0.8:9000", "prefill-0:8100", "[fd00::5]:8200"]
    for value in ("10.0.0.7:8000", "10.0.0.8:9000", "prefill-0:8100", "[fd00::5]:8200"):
        assert outcome(specs, value) == ADMIT, value
    for value in ("10.0.0.7:9000", "10.0.0.8:8000", "prefill-0:8000", "prefill-0:9000",
                  "[fd00::5]:8100", "10.0.0.7:8200", "10.0.0.9:8000"):
        assert outcome(specs, value) == 403, value


def test_no_allowlist_admits_nothing_and_the_first_candidate_decides() -> None:
    assert outcome([], "10.0.0.7:8000") == 403
    # a refused first candidate is not skipped for an admitted second one
    assert outcome(["10.0.0.7:8000"], "10.0.0.8:8000, 10.0.0.7:8000") == 403
    assert outcome(["10.0.0.7:8000"], "@10.0.0.7:8000, 10.0.0.7:8000") == 400


def test_the_sidecars_own_server_is_known_in_any_spelling_but_not_with_a_user_part() -> None:
    own = Backend("http://prefill-0:8000", "prefill")
    sidecar = Sidecar([])
    for value in ("prefill-0:8000", "PREFILL-0:8000", "http://prefill-0:8000/v1"):
        assert sidecar.target({HEADER: value}, [own]) is own, value
    for value in ("@prefill-0:8000", "u@prefill-0:8000"):
        with pytest.raises(BadTarget) as err:
            sidecar.target({HEADER: value}, [own])
        assert err.value.status == 400
    with pytest.raises(BadTarget) as err:
        sidecar.target({HEADER: "prefill-0:8001"}, [own])
    assert err.value.status == 403


def test_one_server_spelled_many_ways_is_one_backend_and_their_number_is_bounded() -> None:
    sidecar = Sidecar([parse_allow("10.0.0.0/8"), parse_allow("prefill-0"),
                       parse_allow("fd00::/64")])
    spellings = [("10.0.0.7:8000", "http://10.0.0.7:8000/", "http://10.0.0.7:8000/v1"),
                 ("prefill-0:8000", "PREFILL-0:8000", "http://Prefill-0:8000"),
                 ("[fd00::5]:8000", "[FD00:0::5]:8000", "http://[fd00:0:0:0:0:0:0:5]:8000")]
    for same in spellings:
        backends = {id(sidecar.target({HEADER: v})) for v in same}
        assert len(backends) == 1, same
    assert sorted(sidecar.backends) == ["http://10.0.0.7:8000", "http://[fd00::5]:8000",
                                        "http://prefill-0:8000"]
    for i in range(MAX_TARGETS + 50):
        sidecar.target({HEADER: f"10.1.{i // 250}.{i % 250 + 1}:8000"})
    assert len(sidecar.backends) == MAX_TARGETS


@given(st.text(max_size=60))
def test_any_header_is_admitted_or_refused_never_an_exception(value: str) -> None:
    sidecar = Sidecar([parse_allow("10.0.0.0/8:8000"), parse_allow("prefill-0"),
                       parse_allow("[fd00::/64]:8000")])
    try:
        backend = sidecar.target({HEADER: value})
    except BadTarget as exc:
        assert exc.status in (400, 403)
        return
    if backend is not None:
        assert "@" not in backend.url
        assert backend.url.startswith(("http://10.", "https://10.", "http://prefill-0:",
                                       "https://prefill-0:", "http://[fd00::",
                                       "https://[fd00::"))


@given(st.ip_addresses(v=4), st.integers(1, 65535), st.sampled_from(["8000", "9000", None]),
       st.integers(8, 32))
def test_an_ipv4_header_is_admitted_exactly_when_its_address_and_port_are_in_the_entry(
        ip: ipaddress.IPv4Address, port: int, entry_port: str | None, prefix: int) -> None:
    network = ipaddress.ip_network(f"10.20.30.40/{prefix}", strict=False)
    spec = f"{network}:{entry_port}" if entry_port else str(network)
    for probe in (ip, network.network_address, network.broadcast_address):
        for p in (port, int(entry_port or port)):
            want = probe in network and (entry_port is None or p == int(entry_port))
            got = outcome([spec], f"{probe}:{p}")
            assert got == (ADMIT if want else 403), (spec, probe, p)


@given(st.ip_addresses(v=6), st.integers(1, 65535), st.integers(16, 128))
def test_an_ipv6_header_is_admitted_exactly_when_its_address_and_port_are_in_the_entry(
        ip: ipaddress.IPv6Address, port: int, prefix: int) -> None:
    network = ipaddress.ip_network(f"fd00:1:2:3:4:5:6:7/{prefix}", strict=False)
    spec = f"[{network}]:8000"
    for probe in (ip, network.network_address, network.broadcast_address):
        for p in (port, 8000):
            got = outcome([spec], f"[{probe}]:{p}")
            if probe.ipv4_mapped is not None or probe.scope_id:
                assert got == 400
                continue
            want = probe in network and p == 8000
            assert got == (ADMIT if want else 403), (spec, probe, p)


# ---------------------------------------------------------------------------------------------
# The control plane: hostile signature headers are a 401, never a 500


def test_the_control_plane_answers_hostile_signature_headers_with_401() -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from lw.contract import auth as control_auth
    from lw.contract.auth import NONCE, SIGNATURE, TIMESTAMP
    from tests.proxy.test_proxy import KEY
    from tests.proxy.test_sidecar import pod

    content = b'{"transfer_id":"t","sub_transfer_id":"t@r","prompt_token_ids":[1]}'

    def signed(ts: str, nonce: str) -> list[tuple[str, bytes]]:
        mac = control_auth._mac(KEY, ts, nonce, content)
        return [(TIMESTAMP, ts.encode("latin-1")), (NONCE, nonce.encode("latin-1")),
                (SIGNATURE, mac.encode())]

    with pod(own_prefill=False) as pd:
        url = pd.control + "/v1/metaserver"
        for headers in (
                [(SIGNATURE, b"\xe9" * 64), (TIMESTAMP, b"1000.000"), (NONCE, b"n" * 16)],
                [(SIGNATURE, b"0" * 64), (TIMESTAMP, b"1000.000\xe9"), (NONCE, b"n" * 16)],
                [(SIGNATURE, b"0" * 64), (TIMESTAMP, b"1000.000"), (NONCE, b"n\xf6nce-01234")],
                signed("nan", "n" * 16),  # right MAC, a timestamp inside every window
                signed("1e12", "n" * 17),
                signed("1000.000", "n\xf6nce-0123456")):
            r = httpx.post(url, content=content, timeout=5,
                           headers=[("content-type", "application/json"), *headers])
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["status"] == "error"
        assert pd.metrics()["prefills"] == 0
