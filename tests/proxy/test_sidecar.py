"""``lw proxy --sidecar`` driven as llm-d's inference scheduler drives its routing sidecar: the
request reaches the decode pod's sidecar with the chosen prefill pod in ``x-prefiller-host-port``
(fake P and D servers of test_proxy; no vLLM). Checked: the named P prefills (never the
sidecar's own fallback), header forms (comma list, repeated, the older ``x-prefiller-url``), a
P outside the allowlist or a malformed header is refused before D sees anything, no header
falls back to the sidecar's own prefill servers or to D alone, other paths reach D, health and
the command line's refusals."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

import httpx  # noqa: E402

from lw.proxy.server import build_apps, main  # noqa: E402
from lw.proxy.sidecar import (  # noqa: E402
    AllowEntry,
    BadTarget,
    Sidecar,
    parse_allow,
    prefiller_from_headers,
)
from tests.proxy.test_proxy import (  # noqa: E402
    KEY,
    TOKENS,
    ServerThread,
    World,
    closed_port_url,
    completion,
    fake_decode,
    fake_prefill,
    lw_detail,
    sse_text,
)

HEADER = "x-prefiller-host-port"


@dataclass
class Pod:
    """A sidecar in front of one fake D, the fake P servers around it, what they saw."""

    url: str
    control: str
    world: World
    p: list[str]  # base URLs of the fake P servers: p[0] is the sidecar's own --prefill
    d: str

    def host_port(self, i: int) -> str:
        return self.p[i].removeprefix("http://")

    def metrics(self) -> dict:
        return httpx.get(self.control + "/metrics-json", timeout=5).json()


@contextlib.contextmanager
def pod(n_prefill: int = 2, own_prefill: bool = True, allow: list[str] | None = None,
        allow_any: bool = False, decode_url: str | None = None) -> Iterator[Pod]:
    """Fake P servers p0.. and a fake D behind a sidecar; the sidecar's own --prefill is p0 (if
    ``own_prefill``); ``allow`` defaults to p1 onwards."""
    world = World(key=KEY)
    servers = [ServerThread(fake_prefill(f"p{i}", world)).start() for i in range(n_prefill)]
    try:
        if decode_url is None:
            d = ServerThread(fake_decode("d0", world)).start()
            servers.append(d)
            decode_url = d.url
        p = [s.url for s in servers[:n_prefill]]
        specs = allow if allow is not None else [u.removeprefix("http://") for u in p[1:]]
        control = ServerThread(None)
        apps = build_apps(p[:1] if own_prefill else [], [decode_url],
                          metaserver_url=control.url + "/v1/metaserver", cluster_key=KEY,
                          timeout_s=10.0,
                          sidecar=Sidecar([parse_allow(s) for s in specs], allow_any=allow_any))
        proxy = ServerThread(apps.public, also=(control, apps.control)).start()
        servers.append(proxy)
        yield Pod(proxy.url, control.url, world, p, decode_url)
    finally:
        world.release.set()
        for s in servers:
            s.stop()


def post(pd: Pod, prompt: str = "hello", headers: dict | list | None = None,
         **extra: object) -> httpx.Response:
    return httpx.post(pd.url + "/v1/completions", json=completion(prompt, **extra),
                      headers=headers, timeout=10)


# ---------------------------------------------------------------------------------------------
# The header and the allowlist (pure)


def test_the_header_names_the_first_candidate_in_any_form() -> None:
    assert prefiller_from_headers({}) is None
    assert prefiller_from_headers({HEADER: "10.0.0.5:8000"}) == "http://10.0.0.5:8000"
    assert prefiller_from_headers({HEADER: " 10.0.0.5:8000 , 10.0.0.6:8000"}) == (
        "http://10.0.0.5:8000")
    assert prefiller_from_headers([(HEADER, "a:1"), (HEADER, "b:2")]) == "http://a:1"
    assert prefiller_from_headers({"X-Prefiller-URL": "http://p.ns.svc:8000"}) == (
        "http://p.ns.svc:8000")
    assert prefiller_from_headers([(HEADER, "a:1"), ("x-prefiller-url", "b:2")]) == "http://a:1"
    assert prefiller_from_headers({HEADER: "[fd00::5]:8000"}) == "http://[fd00::5]:8000"
    assert prefiller_from_headers({HEADER: " , "}) is None


@pytest.mark.parametrize("value", ["10.0.0.5", "10.0.0.5:notaport", "10.0.0.5:99999",
                                   "http://10.0.0.5:8000/v1/x", "ftp://10.0.0.5:21",
                                   "u@10.0.0.5:8000", "10.0.0.5:8000?a=b",
                                   # a user part, an empty one too (urlsplit's username is '')
                                   "@10.0.0.5:8000", ":pw@10.0.0.5:8000", "u:pw@10.0.0.5:8000",
                                   "http://@10.0.0.5:8000", "http://:@10.0.0.5:8000",
                                   "https://@p.ns.svc:8000", "@[fd00::5]:8000"])
def test_a_malformed_header_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(BadTarget) as err:
        prefiller_from_headers({HEADER: value})
    assert err.value.status == 400 and HEADER in str(err.value)


def test_a_user_part_in_the_header_is_refused_even_with_allow_any() -> None:
    for value in ("@10.0.0.5:8000", "http://@10.0.0.5:8000", ":pw@10.0.0.5:8000"):
        with pytest.raises(BadTarget) as err:
            Sidecar([], allow_any=True).target({HEADER: value})
        assert err.value.status == 400 and "user part" in str(err.value)


def test_allowlist_entries() -> None:
    assert parse_allow("10.0.0.0/16:8000").admits("10.0.3.4", 8000)
    assert not parse_allow("10.0.0.0/16:8000").admits("10.0.3.4", 8001)
    assert not parse_allow("10.0.0.0/16").admits("10.1.0.1", 8000)
    assert parse_allow("10.0.0.0/16").admits("10.0.255.1", 1)
    assert parse_allow("10.0.0.7").admits("10.0.0.7", 9) and not parse_allow(
        "10.0.0.7").admits("10.0.0.8", 9)
    assert parse_allow("Prefill-0.ns.svc:8000").admits("prefill-0.ns.svc", 8000)
    assert not parse_allow("prefill-0.ns.svc:8000").admits("prefill-1.ns.svc", 8000)
    assert not parse_allow("10.0.0.0/8").admits("prefill.ns.svc", 80)  # names are not resolved
    assert parse_allow("[fd00::/64]:8000").admits("fd00::9", 8000)
    assert parse_allow("http://10.0.0.7:8000") == AllowEntry(
        network=parse_allow("10.0.0.7").network, port=8000)


@pytest.mark.parametrize("spec", ["", ":8000", "10.0.0.0/33", "host:port", "host:0",
                                  "[fd00::]x", "bad host", "a/b", "http://h/path",
                                  # a user part, an empty one too
                                  "@host:8000", ":pw@host:8000", "user@host:8000",
                                  "http://@host:8000", "http://user:pw@host:8000",
                                  "@a-b:8000", ":pw@host-1:8000", "u@10.0.0.0/8",
                                  "[u@fd00::1]:8000", "@10.0.0.7",
                                  # once passed as names: '-' anywhere made any label valid
                                  "bad-host x", "a-b/c", "p\u00e4-0.ns"])
def test_bad_allowlist_entries_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="allowed prefiller"):
        parse_allow(spec)


# ---------------------------------------------------------------------------------------------
# Driven as the scheduler drives it


@pytest.mark.parametrize("stream", [False, True])
def test_the_named_prefill_server_prefills(stream: bool) -> None:
    with pod() as pd:
        r = post(pd, headers={HEADER: pd.host_port(1)}, stream=stream)
        assert r.status_code == 200, r.text
        text = sse_text(r.text) if stream else r.json()["choices"][0]["text"]
        assert text == "".join(TOKENS)
        assert pd.world.servers("p_request") == ["p1"]  # not the sidecar's own p0
        rid = r.headers["x-request-id"]
        assert pd.world.has("d_request", "d0", rid)
        prefill = {b["url"]: b for b in pd.metrics()["prefill"]}
        assert prefill[pd.p[1]]["requests"] == 1 and prefill[pd.p[0]]["requests"] == 0
        assert prefill[pd.p[1]]["in_flight"] == 0 and pd.metrics()["in_flight"] == 0


def test_header_forms_and_the_sidecars_own_server_named() -> None:
    with pod(n_prefill=3) as pd:
        for headers, want in (
                ([(HEADER, f"{pd.host_port(2)}, {pd.host_port(1)}")], "p2"),
                ([(HEADER, pd.host_port(1)), (HEADER, pd.host_port(2))], "p1"),
                ([("x-prefiller-url", pd.p[2])], "p2"),
                ([(HEADER, pd.host_port(0))], "p0")):  # its own: always allowed
            before = len(pd.world.servers("p_request"))
            r = post(pd, headers=headers)
            assert r.status_code == 200, (headers, r.text)
            assert pd.world.servers("p_request")[before:] == [want], headers


def test_a_prefill_server_outside_the_allowlist_is_refused_before_d_sees_it() -> None:
    with pod(allow=["10.99.0.0/16"]) as pd:
        r = post(pd, headers={HEADER: pd.host_port(1)})
        assert r.status_code == 403
        err = r.json()["error"]
        assert err["type"] == "ForbiddenError" and err["code"] == 403
        assert pd.host_port(1) in err["message"] and lw_detail(err)["stage"] == "sidecar"
        assert not pd.world.has("d_request") and not pd.world.has("p_request")
        assert pd.metrics()["in_flight"] == 0
        r = post(pd, headers={HEADER: "no-port-here"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        assert not pd.world.has("d_request")
        m = pd.metrics()  # the client's fault, counted as such: no backend error
        assert m["prefiller_refused"] == 2 and m["errors"] == 0, m


def test_allow_any_accepts_a_server_named_by_the_header() -> None:
    with pod(allow=[], allow_any=True) as pd:
        assert post(pd, headers={HEADER: pd.host_port(1)}).status_code == 200
        assert pd.world.servers("p_request") == ["p1"]


def test_an_unreachable_named_prefill_server_is_a_502_naming_it() -> None:
    dead = closed_port_url()
    with pod(allow=[dead]) as pd:
        r = post(pd, headers={HEADER: dead.removeprefix("http://")})
        assert r.status_code == 502
        detail = lw_detail(r.json()["error"])
        assert detail["stage"] == "prefill" and detail["server"] == dead
        assert pd.world.has("d_cancelled") or not pd.world.has("d_done")


def test_no_header_falls_back_to_the_sidecars_own_prefill_server() -> None:
    with pod() as pd:
        assert post(pd).status_code == 200
        assert pd.world.servers("p_request") == ["p0"]


@pytest.mark.parametrize("stream", [False, True])
def test_no_header_and_no_prefill_server_lets_d_compute_alone(stream: bool) -> None:
    with pod(own_prefill=False) as pd:
        r = post(pd, "alone please", stream=stream)
        assert r.status_code == 200, r.text
        assert (sse_text(r.text) if stream else r.json()["choices"][0]["text"]) == "".join(
            TOKENS)
        assert pd.world.has("d_alone") and not pd.world.has("d_request")
        m = pd.metrics()
        assert m["metaserver_calls"] == 0 and m["prefills"] == 0 and m["in_flight"] == 0
        # a header still makes it P/D
        assert post(pd, headers={HEADER: pd.host_port(1)}).status_code == 200
        assert pd.world.servers("p_request") == ["p1"]


def test_other_paths_are_the_decode_servers() -> None:
    with pod() as pd:
        r = httpx.get(pd.url + "/metrics", timeout=5)
        assert r.status_code == 200 and 'fake_vllm_up{server="d0"} 1' in r.text
        r = httpx.post(pd.url + "/tokenize?add_special_tokens=true", json={"prompt": "ab"},
                       timeout=5)
        assert r.json() == {"tokens": [97, 98], "server": "d0",
                            "query": "add_special_tokens=true"}
        assert httpx.get(pd.url + "/nowhere", timeout=5).status_code == 404  # D's own 404
        # the control plane is not among them: D answers, no prefill starts
        assert httpx.post(pd.url + "/v1/metaserver", json={}, timeout=5).status_code in (
            404, 405)
        assert httpx.get(pd.url + "/lw/workers", timeout=5).status_code == 404
        assert not pd.world.has("p_request")


def test_health_is_the_decode_servers_and_a_dead_one_is_a_502() -> None:
    with pod(own_prefill=False) as pd:
        assert httpx.get(pd.url + "/health", timeout=5).status_code == 200
    dead = closed_port_url()
    with pod(own_prefill=False, decode_url=dead) as pd:
        assert httpx.get(pd.url + "/health", timeout=5).status_code == 503
        r = httpx.get(pd.url + "/metrics", timeout=5)
        assert r.status_code == 502 and lw_detail(r.json()["error"])["server"] == "decode#0"
        assert dead not in r.text  # the pod's own server is named by role, not URL


@pytest.mark.parametrize("argv,fragment", [
    (["--sidecar", "--decode", "http://d:1", "--decode", "http://d:2",
      "--allow-any-prefiller"], "exactly one"),
    (["--sidecar", "--decode", "http://d:1"], "--allow-prefiller SPEC"),
    (["--decode", "http://d:1", "--prefill", "http://p:1", "--allow-prefiller", "10.0.0.0/8"],
     "only with --sidecar"),
    (["--sidecar", "--decode", "http://d:1", "--allow-prefiller", "10.0.0.0/33"],
     "allowed prefiller"),
    (["--decode", "http://d:1"], "at least one --prefill"),
])
def test_the_command_line_refuses_what_cannot_work(
        argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--insecure-trusted-network"])
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err
