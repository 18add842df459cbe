"""``lw proxy`` start-up refusals (ports, timeouts, URLs, log level, signature window) and the
serving loop's bounds on request heads: their size and how long one may take to arrive."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

import lw.proxy.server as srv
from lw.contract.auth import CallVerifier
from lw.proxy.server import _listen, _serve, build_apps, main
from lw.proxy.state import server_url

BASE = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200",
        "--insecure-trusted-network"]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """main() up to its serving loop: nothing listens; the loop's arguments are recorded."""
    calls: list[Any] = []
    monkeypatch.setattr(srv, "_listen", lambda host, port: socket.socket())

    async def fake_serve(apps: Any, public: socket.socket, control: socket.socket,
                         log_level: str) -> None:
        public.close()
        control.close()
        calls.append((apps, log_level))
        await apps.state.aclose()

    monkeypatch.setattr(srv, "_serve", fake_serve)
    return calls


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--port", "70000"], "argument --port: invalid port (0..65535) value: '70000'"),
    (["--port", "-5"], "argument --port: invalid port"),
    (["--control-port", "99999"], "argument --control-port: invalid port"),
    (["--port", "65535"], "--port 65535 leaves no default control port (65536)"),
    (["--timeout", "-1"], "argument --timeout: invalid positive finite number value: '-1'"),
    (["--timeout", "0"], "argument --timeout: invalid positive finite"),
    (["--timeout", "nan"], "argument --timeout: invalid positive finite"),
    (["--connect-timeout", "nan"], "argument --connect-timeout: invalid positive finite"),
    (["--connect-timeout", "-1"], "argument --connect-timeout: invalid positive finite"),
    (["--signature-window", "nan"], "argument --signature-window: invalid positive finite"),
    (["--signature-window", "inf"], "argument --signature-window: invalid positive finite"),
    (["--max-body-mb", "inf"], "argument --max-body-mb: invalid positive finite"),
    (["--max-body-mb", "nan"], "argument --max-body-mb: invalid positive finite"),
    (["--why-timeout", "0"], "argument --why-timeout: invalid positive finite"),
    (["--why-timeout", "inf"], "argument --why-timeout: invalid positive finite"),
    (["--log-level", "bogus"], "argument --log-level: invalid choice: 'bogus'"),
    (["--prefill", "ftp://10.0.0.1:8100"], "--prefill: 'ftp://10.0.0.1:8100': scheme 'ftp'"),
    (["--prefill", "http://[::1"], "--prefill: 'http://[::1' is not a URL"),
    (["--decode", "http://host:99999"], "--decode: 'http://host:99999' is not a URL"),
    (["--decode", "http://10.0.0.1:82OO"], "--decode: 'http://10.0.0.1:82OO' is not a URL"),
    (["--decode", "http://:8000"], "no host"),
    (["--decode", "http://127.0.0.1:8100/"], "is given as --prefill and as --decode"),
    (["--metaserver-url", "notaurl"], "--metaserver-url 'notaurl': not an http(s) URL D"),
    (["--metaserver-url", "http://u@h:1/v1/metaserver"], "--metaserver-url"),
    (["--metaserver-url", "http://h:99999/v1/metaserver"], "--metaserver-url"),
])
def test_the_command_line_refuses_bad_settings_naming_the_flag(
        argv: list[str], fragment: str, started: list[Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*BASE, *argv])
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err
    assert not started


def test_good_settings_still_start(started: list[Any]) -> None:
    assert main([*BASE, "--port", "65535", "--control-port", "8001", "--log-level", "WARNING",
                 "--timeout", "0.5", "--metaserver-url", "http://10.0.0.1:8001/v1/metaserver",
                 "--decode", "https://[::1]:8300/v1"]) == 0
    (apps, level), = started
    assert level == "warning"
    assert [b.url for b in apps.state.decodes] == ["http://127.0.0.1:8200", "https://[::1]:8300"]


@pytest.mark.parametrize("window", [float("nan"), float("inf"), 0.0, -1.0])
def test_the_signature_window_must_be_positive_and_finite(window: float) -> None:
    with pytest.raises(ValueError, match="signature window"):
        CallVerifier(b"k" * 32, window)


@pytest.mark.parametrize("url", ["ftp://h:1", "http://[::1", "http://h:99999", "http://h:0",
                                 "http://h:8a", "http://h:1/?q=1", "http://h x:1"])
def test_server_urls_are_checked(url: str) -> None:
    with pytest.raises(ValueError, match="http|URL|port|query|ASCII"):
        server_url(url)


@pytest.mark.parametrize("over", [{"timeout_s": float("nan")}, {"connect_timeout_s": -1.0},
                                  {"timeout_s": float("inf")}])
def test_build_apps_refuses_non_finite_timeouts(over: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be > 0 seconds and finite"):
        build_apps(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], metaserver_url="http://x:3",
                   cluster_key=None, insecure_trusted_network=True, **over)


# ------------------------------------------------------------------------ the serving loop
async def _against_proxy(check: Any) -> None:
    """Run ``check(port)`` against a proxy served by _serve with a 0.3 s head deadline."""
    public, control = _listen("127.0.0.1", 0), _listen("127.0.0.1", 0)
    port = public.getsockname()[1]
    apps = build_apps(["http://127.0.0.1:9"], ["http://127.0.0.1:10"],
                      metaserver_url="http://127.0.0.1:11/v1/metaserver", cluster_key=None,
                      insecure_trusted_network=True, start_mode="d-first")
    task = asyncio.ensure_future(_serve(apps, public, control, "warning", head_timeout_s=0.3))
    try:
        for _ in range(200):  # until it listens (generous: a loaded 2-core machine)
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        await check(port)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before closing (fails if it keeps the connection for 10 s)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout=10)
    except ConnectionResetError:
        return b""


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_without_a_complete_head_is_closed(sent: bytes) -> None:
    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sent)
        await writer.drain()
        assert await _closed_by_server(reader) == b""
        writer.close()

    asyncio.run(_against_proxy(check))


def test_a_dripping_head_is_closed_too() -> None:
    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        closed = asyncio.ensure_future(_closed_by_server(reader))
        writer.write(b"GET /health HTTP/1.1\r\n")
        for _ in range(100):  # a header every 0.1 s: each byte used to reset the deadline
            if closed.done():
                break
            await asyncio.sleep(0.1)
            writer.write(b"X-A: b\r\n")
        assert closed.done() and closed.result() == b""
        writer.close()

    asyncio.run(_against_proxy(check))


def test_an_oversized_head_is_refused_and_a_normal_one_answered() -> None:
    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /nowhere HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (16 << 10)
                     + b"\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout=10)
        assert head.startswith(b"HTTP/1.1 404")  # a 16 KiB header is no problem
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(100):  # 100 KiB of head, over the 64 KiB bound
                writer.write(b"X-Pad: " + b"a" * 1024 + b"\r\n")
                await writer.drain()
        except OSError:
            pass  # refused while still sending
        answer = await _closed_by_server(reader)
        assert answer.startswith(b"HTTP/1.1 400") or answer == b""
        writer.close()

    asyncio.run(_against_proxy(check))
