"""Faults after the client holds token 1, on real vLLM servers: two prefill servers, one D with
``retry_prefill: 1`` and ``kv_checksum`` on both sides, the proxy, and a single engine for the
outputs to equal (issue 59: "token 1 is never contradicted").

Each case holds P's KV writes while a flag file exists (lw.transport.dataplane.planted): the
client's first token (P's sampled token, streamed by D at once) has arrived while not one byte
of the prompt's KV has landed, whatever the machine's speed; then the fault is planted on the
prefill server that holds the request (its ``.held`` marker says which), and the writes are
let go. The flags are per server (``LocalCluster.server_env``), so the other P runs clean.
- a transfer cut once (checksum mismatch) -> prefilled again, on the other P, and D continues
  from the token the client holds: the output equals the single engine's, greedy and seeded;
- a transfer cut on every attempt -> the client gets an error after token 1, in-band;
- the P holding the request killed -> prefilled again on the other P, output equal (greedy and
  seeded; a killed server is started again before the next kill case, not after its own);
- every P killed -> the re-prefill has nowhere to go: an in-band error after token 1.
The held writes stand in for issue 59's kv/prefill 2.0 link: what the fault needs is that the KV
has not landed when token 1 reaches the client, and holding makes that certain instead of likely.
Each case ends with every block of D released and no live lw request left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")
pytest.importorskip("httpx")

import httpx  # noqa: E402

from lw.lab.demo_client import wait_blocks_released  # noqa: E402
from lw.lab.local_cluster import Server, wait_ready  # noqa: E402
from lw.lab.tiny_model import make_tiny_model  # noqa: E402
from lw.lab.vllm_demo import MODEL_NAME, LocalCluster, make_prompt, metrics  # noqa: E402
from lw.ops.client import query  # noqa: E402
from lw.transport.dataplane.planted import HELD_SUFFIX, HOLD_ENV, TRUNCATE_ENV  # noqa: E402

pytestmark = pytest.mark.slow

CHECKSUM = {"kv_checksum": True}
# P's push deadline, 6 s on both sides: P's writes time out after 6 s (derived from it; a
# write stuck on a connection D's fence cut holds P's admission of the next push to that D
# until it ends, and the default, 30 s, would outlast D's deadline), D's lease is 18 s. A
# killed P is found by heartbeats, not known dead: its re-prefill waits out the lease, so
# the lease is most of each kill case's time (the writes are held under 6 s: a cut case
# releases them as soon as the client holds token 1)
REQUEST_TIMEOUT_S = 6
P_EXTRA = {"request_timeout_s": REQUEST_TIMEOUT_S, **CHECKSUM}
D_EXTRA = {"prefill_timeout_s": 15, "request_timeout_s": REQUEST_TIMEOUT_S, "retry_prefill": 1,
           **CHECKSUM}
LEASE_S = 3.0 * REQUEST_TIMEOUT_S
"""D's lease: derived, 2 × request_timeout_s + the transfer timeout, itself request_timeout_s
(test_config_keys.py)."""
MAX_TOKENS = 12
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.8, "seed": 11}
SETTLE_S = LEASE_S + D_EXTRA["prefill_timeout_s"] + 30  # the slowest fault path
WHY_TIMEOUT = "5"
"""The proxy's wait for D's workers to say why a request failed: with 0.5 s (the default) a
rehearsal's cut-on-every-attempt case got "cause unknown: the decode server's workers did not
answer within 0.5 s" instead of the checksum mismatch, as test_e2e_shapes.py's did before."""


@dataclass
class Flags:
    """One prefill server's planted-fault files: writes held while ``hold`` exists, cut while
    ``cut`` says so."""

    hold: Path
    cut: Path

    @property
    def held(self) -> Path:
        """Written by the server's data plane once it holds a write."""
        return Path(str(self.hold) + HELD_SUFFIX)

    def release(self) -> None:
        """Let the held writes go (and forget that any were held)."""
        self.hold.unlink(missing_ok=True)
        self.held.unlink(missing_ok=True)


_flags: dict[str, Flags] = {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            shared_reference: Callable[[str], Server]) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("failover")
    names = ["prefill", "prefill2"]
    for name in names:
        _flags[name] = Flags(work / f"hold-{name}", work / f"cut-{name}")
    c = LocalCluster(model=make_tiny_model(work / "model"), workdir=work / "logs",
                     shared_reference=shared_reference("llama"), p_extra=P_EXTRA,
                     d_extra=D_EXTRA, prefill_servers=2, proxy_args=["--why-timeout", WHY_TIMEOUT],
                     server_env={n: {HOLD_ENV: str(f.hold), TRUNCATE_ENV: str(f.cut)}
                                 for n, f in _flags.items()})
    assert c.prefill_names == names
    try:
        c.start(timeout=480)
        yield c
    finally:
        c.stop()


@dataclass
class Stream:
    """A streamed completion read in a thread: its token ids, when token 1 arrived, and an
    in-band error (vLLM's ``data: {"error": ...}`` event) if one came."""

    url: str
    body: dict[str, Any]
    tokens: list[int] = field(default_factory=list)
    error: str = ""
    finish_reason: str | None = None
    first: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        """Send the request (the answer is read in a daemon thread)."""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body,
                              timeout=SETTLE_S + 60) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')}"
                    return
                for line in r.iter_lines():
                    data = line.removeprefix("data:").strip()
                    if not line.startswith("data:") or data == "[DONE]":
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        self.error = json.dumps(event["error"])
                        return
                    for choice in event.get("choices", ()):
                        self.tokens += choice.get("token_ids") or ()
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                        if self.tokens:
                            self.first.set()
        except (httpx.HTTPError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.first.set()  # nothing more will come

    def join(self, timeout: float = SETTLE_S) -> None:
        """Wait for the whole answer (an assertion error if it hangs)."""
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the client hung: {self.tokens} {self.error}"


def _body(prompt: str, sampling: dict[str, Any], stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "return_token_ids": True, "stream": stream, **sampling}


def _reference(c: LocalCluster, prompt: str, sampling: dict[str, Any]) -> list[int]:
    """The single engine's token ids for this prompt and sampling."""
    r = httpx.post(c.url("reference") + "/v1/completions",
                   json=_body(prompt, sampling, stream=False), timeout=120)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return list(choice["token_ids"])


def _token_1_then_held(c: LocalCluster, prompt: str, sampling: dict[str, Any]
                       ) -> tuple[Stream, str]:
    """Start a streamed request with every P's writes held; return it once the client holds
    token 1, and the prefill server that holds its KV."""
    for f in _flags.values():
        f.hold.touch()
    s = Stream(c.url("proxy"), _body(prompt, sampling)).start()
    assert s.first.wait(SETTLE_S), "no first token"
    assert s.tokens and not s.error, (s.tokens, s.error)
    holding = [n for n, f in _flags.items() if f.held.exists()]
    assert len(holding) == 1, f"writes held on {holding}: expected the one P of the request"
    return s, holding[0]


def _d_counter(c: LocalCluster, name: str) -> float:
    """A core counter of D's worker (its status reply)."""
    snap = query(c.status_workers()[-1:], c.cluster_key, timeout_s=30)
    assert not snap.silent, snap.silent
    return sum(r.counters.get(name, 0.0) for r in snap.replies)


def _first_token_counts(c: LocalCluster) -> tuple[float, float]:
    """D's (first tokens taken from P, last prompt tokens recomputed)."""
    m = metrics(c.url("decode"))
    return m.get("lw_first_token_from_p_total", 0.0), m.get("lw_last_token_recomputed_total", 0.0)


def _settled(c: LocalCluster) -> None:
    """Every block back and no lw request live, on D and on each prefill server still up (the
    next case starts from a quiet cluster)."""
    urls = [c.url(n) for n in (*c.prefill_names, "decode") if c.servers[n].alive]
    assert wait_blocks_released(urls, timeout=LEASE_S + 10) == 0
    deadline = time.monotonic() + 30
    while any(metrics(u).get("lw_live_requests", 0) for u in urls) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert {u: metrics(u).get("lw_live_requests", 0) for u in urls} == dict.fromkeys(urls, 0)


def _wait_counts(c: LocalCluster, want_from_p: float) -> tuple[float, float]:
    """D's first-token counts once ``want_from_p`` is reached (stats reach /metrics on vLLM's
    interval) or 30 s passed."""
    deadline = time.monotonic() + 30
    while (got := _first_token_counts(c))[0] < want_from_p and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_transfer_cut_after_token_1_is_prefilled_again_and_continues_from_it(
        cluster: LocalCluster, sampling: dict[str, Any]) -> None:
    """The client holds P's token 1; P's writes are then cut once (checksum mismatch on D): D
    asks for a new prefill, whose P samples again (discarded), and continues from the token
    the client holds: the output equals the single engine's."""
    prompt = make_prompt(150, seed=900 + len(sampling))
    want = _reference(cluster, prompt, sampling)
    mismatches = _d_counter(cluster, "core.checksum_mismatches")
    reprefills = _d_counter(cluster, "core.reprefills")
    from_p, recomputed = _first_token_counts(cluster)
    s, holding = _token_1_then_held(cluster, prompt, sampling)
    cut = _flags[holding].cut
    cut.write_text("64 1")  # that P's next write only (the held ones go out first)
    try:
        for f in _flags.values():
            f.release()
        s.join()
    finally:
        cut.unlink(missing_ok=True)
    assert not s.error, s.error
    assert s.tokens == want, f"P/D {s.tokens} != single engine {want}"
    assert _d_counter(cluster, "core.checksum_mismatches") == mismatches + 1
    assert _d_counter(cluster, "core.reprefills") == reprefills + 1
    assert _wait_counts(cluster, from_p + 1) == (from_p + 1, recomputed)
    _settled(cluster)


def test_a_transfer_cut_on_every_attempt_after_token_1_is_an_in_band_error(
        cluster: LocalCluster) -> None:
    """Both attempts' KV cut (the retry budget spent): the client, holding token 1, gets an
    error in the stream that names the KV transfer, not a hang and not other tokens."""
    prompt = make_prompt(150, seed=910)
    want = _reference(cluster, prompt, GREEDY)
    s, _ = _token_1_then_held(cluster, prompt, GREEDY)
    for f in _flags.values():
        f.cut.write_text("64")  # every write of every P while it exists
    try:
        for f in _flags.values():
            f.release()
        s.join()
    finally:
        for f in _flags.values():
            f.cut.unlink(missing_ok=True)
    assert s.tokens == want[:1], (s.tokens, want)
    assert "KV transfer" in s.error and "checksum mismatch" in s.error, s.error
    _settled(cluster)


KILL_WAIT_S = 120.0
"""How long a SIGKILLed server may take to be reaped: its exit is slow at times on a loaded
machine (a CI run of 2026-12-06 waited more than 30 s for one); what the cases need is that
it is gone, not how fast the kernel tears it down."""


def _kill(c: LocalCluster, *names: str) -> None:
    """SIGKILL the servers' process groups at once, then wait for each to be reaped; on a
    timeout say what each thread of the one left was doing."""
    for name in names:
        os.killpg(c.servers[name].proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
    for name in names:
        proc = c.servers[name].proc
        assert proc is not None
        try:
            proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} (pid {proc.pid}) not reaped {KILL_WAIT_S:.0f} s after "
                        f"SIGKILL; its threads: {_threads(proc.pid)}")


def _every_prefill_server_up(c: LocalCluster) -> None:
    """Start again the prefill servers an earlier case killed: a kill case needs the other P
    to fail over to. (Started here, not after each kill: the last case would kill it again.)"""
    dead = [c.servers[n] for n in c.prefill_names if not c.servers[n].alive]
    for server in dead:
        server.start()
    wait_ready(dead, 300)


def _threads(pid: int) -> str:
    """Each thread's state and kernel wait channel, from /proc."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text()
        except OSError:
            continue
        out.append(f"{task.name}:{state}:{wchan}")
    return " ".join(out) or "none left in /proc"


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_prefill_server_killed_after_token_1_the_other_one_prefills_and_d_continues(
        cluster: LocalCluster, sampling: dict[str, Any]) -> None:
    """The client holds P's token 1, then the P holding the request's KV is killed: D finds it
    lost, asks for a new prefill, the proxy sends it to the other P, and D continues from the
    token the client holds: the output equals the single engine's. A server an earlier
    case killed is started again first."""
    _every_prefill_server_up(cluster)
    prompt = make_prompt(150, seed=920 + len(sampling))
    want = _reference(cluster, prompt, sampling)
    reprefills = _d_counter(cluster, "core.reprefills")
    from_p, recomputed = _first_token_counts(cluster)
    s, holding = _token_1_then_held(cluster, prompt, sampling)
    for name, f in _flags.items():
        if name != holding:
            f.release()
    _kill(cluster, holding)
    _flags[holding].release()  # its writes died with it; a restarted server must not hold
    s.join()
    assert not s.error, s.error
    assert s.tokens == want, f"P/D {s.tokens} != single engine {want}"
    assert _d_counter(cluster, "core.reprefills") == reprefills + 1
    assert _wait_counts(cluster, from_p + 1) == (from_p + 1, recomputed)
    _settled(cluster)


def test_with_no_prefill_server_left_after_token_1_the_client_gets_an_in_band_error(
        cluster: LocalCluster) -> None:
    """Every prefill server still up killed once the client holds token 1 (the case before
    left one): D's re-prefill has nowhere to go, and the client gets an error in the stream
    after its token, not a hang; D's blocks come back. (Last in the module: it leaves the
    cluster without a prefill server.)"""
    prompt = make_prompt(150, seed=930)
    want = _reference(cluster, prompt, GREEDY)
    s, _ = _token_1_then_held(cluster, prompt, GREEDY)
    _kill(cluster, *[n for n in cluster.prefill_names if cluster.servers[n].alive])
    for f in _flags.values():
        f.release()
    s.join()
    assert s.tokens == want[:1], (s.tokens, want)
    assert s.error, "no error after both prefill servers died"
    assert metrics(cluster.url("decode")).get("lw_prefill_retries_total", 0) >= 1
    _settled(cluster)
