"""The pure parts of ``lw hostile`` (lw.lab.hostile: table, cases, probes, run): the
messages and params read from answers, what counts as reached / acted on / an error / unmet, the
rows, the summary line, the exit status, the sidecar's cases and command line. No engine is
started here; the table itself runs against real engines (``lw hostile``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lw.cli import COMMANDS
from lw.lab import hostile
from lw.lab.hostile import cases, probes, run, table
from lw.lab.hostile.table import Answer, Deltas, Row

SUMMARY = re.compile(r"^summary cases=(\d+) refused=(\d+) reached_engine=(\d+) "
                     r"engine_errors=(\d+) leaked_blocks=(\d+) max_rss_growth_mb=(\d+\.\d)$")


def row(status: int | None = 400, target: str = "public", **kw: Any) -> Row:
    deltas = kw.pop("deltas", Deltas())
    return Row(kw.pop("key", "1"), kw.pop("name", "case"), target, kw.pop("sent", "x"),
               Answer(status, kw.pop("message", "m")), deltas,
               rss_before_kb=kw.pop("before", 50 * 1024), rss_after_kb=kw.pop("after", 50 * 1024),
               rss_peak_kb=kw.pop("peak", 50 * 1024), **kw)


# ------------------------------------------------------------------------------ messages
def test_answer_message_reads_vllms_error_shape_with_its_param() -> None:
    body = {"error": {"message": "must not be set (got str)", "type": "BadRequestError",
                      "param": "vllm_xargs.kv_transfer_params", "code": 400}}
    msg = table.answer_message(400, json.dumps(body).encode())
    assert msg.startswith("[vllm_xargs.kv_transfer_params] must not be set")
    # a message that already names the field is not prefixed again
    body["error"]["message"] = "vllm_xargs.kv_transfer_params: must not be set"
    assert table.answer_message(400, json.dumps(body)) == \
        "vllm_xargs.kv_transfer_params: must not be set"


def test_answer_message_reads_control_details_old_shapes_and_text() -> None:
    assert table.answer_message(401, b'{"status": "error", "detail": "unsigned call"}') == \
        "unsigned call"
    assert table.answer_message(400, b'{"object": "error", "message": "bad"}') == "bad"
    assert table.answer_message(422, b'{"detail": [{"loc": ["body"]}]}').startswith('[{"loc"')
    assert table.answer_message(502, b"Bad Gateway\n\n  upstream") == "Bad Gateway upstream"


def test_answer_message_of_a_served_request_shows_its_text() -> None:
    body = {"choices": [{"text": " the water"}]}
    assert table.answer_message(200, json.dumps(body).encode()) == "(served) ' the water'"
    chat = {"choices": [{"message": {"content": "hi"}}]}
    assert table.answer_message(200, json.dumps(chat)) == "(served) 'hi'"
    assert table.answer_message(204, b"") == "(served)"


def test_answer_message_is_clipped_to_one_short_line() -> None:
    msg = table.answer_message(400, json.dumps({"error": {"message": "a\nb " * 100}}).encode())
    assert len(msg) == table.MESSAGE_CHARS and "\n" not in msg and msg.endswith("~")


def test_answer_param_reads_the_errors_param() -> None:
    body = {"error": {"message": "m", "param": "vllm_xargs.kv_transfer_params"}}
    assert table.answer_param(json.dumps(body).encode()) == "vllm_xargs.kv_transfer_params"
    assert table.answer_param(b'{"error": {"message": "m", "param": null}}') is None
    assert table.answer_param(b'{"detail": "x"}') is None
    assert table.answer_param(b"not json") is None and table.answer_param(b"") is None
    assert table.answer_param(b'{"error": "text"}') is None


# ------------------------------------------------------------------------------ deltas
def test_deltas_between_snapshots() -> None:
    before = {"d": {table.REFUSED: 2.0, "lw_requests_done_total": 5.0}, "p": {},
              "proxy": {"client_transfer_params_dropped": 1, "bodies_too_large": 0},
              "canary": 0}
    after = {"d": {table.REFUSED: 3.0, "lw_requests_done_total": 5.0,
                   "lw_metaserver_failures_total": 1.0},
             "p": {table.REFUSED: 1.0, "lw_transfers_total": 4.0},
             "proxy": {"client_transfer_params_dropped": 2, "bodies_too_large": 1,
                       "metaserver_refused": 3, "prefills": 1}, "canary": 2}
    d = table.deltas_between(before, after, "probes")
    assert d == Deltas(canary=2, d_refused=1, p_refused=1, d_used=1, p_used=4, dropped=1,
                       proxy_refused=0, too_large=1, meta_refused=3, prefills=1,
                       probes="probes")


def test_deltas_of_a_sidecar_case_are_the_sidecars_counters() -> None:
    before = {"d": {}, "p": {}, "proxy": {"client_transfer_params_dropped": 1},
              "sidecar": {"client_transfer_params_dropped": 4, "bodies_too_large": 0},
              "canary": 0}
    after = {"d": {}, "p": {}, "proxy": {"client_transfer_params_dropped": 3},
             "sidecar": {"client_transfer_params_dropped": 5, "bodies_too_large": 1,
                         "prefills": 2}, "canary": 0}
    assert table.deltas_between(before, after, counters="sidecar") == \
        Deltas(dropped=1, too_large=1, prefills=2)
    assert table.deltas_between(before, after) == Deltas(dropped=2)
    # a sidecar that did not answer moves nothing
    assert table.deltas_between({"sidecar": {}}, {}, counters="sidecar") == Deltas()


def test_deltas_of_engines_that_did_not_answer_are_zero() -> None:
    assert table.deltas_between({"d": {}, "p": {}, "proxy": {}, "canary": 0},
                            {"d": {}, "p": {}, "proxy": {}, "canary": 0}) == Deltas()


# ------------------------------------------------------------------------------ verdicts
def test_a_canary_contact_is_acting_on_the_case_wherever_it_was_sent() -> None:
    for target in table.TARGETS:
        r = row(200, target, deltas=Deltas(canary=1))
        assert table.acted(r) and table.outcome(r) == "ACTED ON"
        assert "canary contacted 1x" in table.verdict_text(r)


def test_engine_use_counts_only_for_cases_sent_straight_to_an_engine() -> None:
    used = Deltas(d_used=2, p_used=3, prefills=1)
    assert table.acted(row(200, "decode", deltas=used))
    assert table.acted(row(200, "prefill", deltas=Deltas(p_used=1)))
    # through the proxy the engines' work is the proxy's own (signed) transfer
    assert not table.acted(row(200, "public", deltas=used))
    assert table.outcome(row(200, "public", deltas=used)) == "served"


def test_engine_use_during_a_sidecar_case_is_acting_on_it() -> None:
    # no sidecar case names a prefill server it allows: the sidecar starts no transfer itself
    r = row(200, "sidecar", deltas=Deltas(d_used=1))
    assert table.acted(r) and table.verdict_text(r) == "ACTED ON: D used params (1)"
    assert not row(200, "sidecar").direct and row(200, "sidecar").framed
    r = row(403, "sidecar", deltas=Deltas(prefills=1))
    assert table.acted(r) and table.verdict_text(r) == "ACTED ON: 1 prefill(s) started"
    assert row(200, "decode").framed and not row(200, "public").framed


def test_a_control_call_that_started_a_prefill_is_acting_on_it() -> None:
    r = row(202, "control", deltas=Deltas(prefills=1))
    assert table.acted(r) and "1 prefill(s) started" in table.verdict_text(r)


@pytest.mark.parametrize(("r", "kind", "text"), [
    (row(400), "refused", "refused 400"),
    (row(413), "refused", "refused 413"),
    (row(200, deltas=Deltas(dropped=1)), "served", "served; params dropped by proxy"),
    (row(200, "decode", deltas=Deltas(d_refused=1)), "served",
     "served; params refused by D connector"),
    (row(200, "prefill", deltas=Deltas(p_refused=1, d_refused=1)), "served",
     "served; params refused by D+P connector"),
    (row(200), "served", "served harmlessly"),
    (row(200, "sidecar", deltas=Deltas(dropped=1)), "served",
     "served; params dropped by sidecar"),
    (row(403, "sidecar"), "refused", "refused 403"),
    (row(None), "no answer", "no answer (connection closed)"),
    (row(502), "ERROR", "ERROR: HTTP 502"),
    (row(400, healthy=False, detail="P /health 503"), "ERROR",
     "ERROR: health check failed (P /health 503)"),
    (row(400, honest_ok=False), "ERROR", "ERROR: honest request failed"),
])
def test_outcome_and_verdict(r: Row, kind: str, text: str) -> None:
    assert table.outcome(r) == kind
    assert table.verdict_text(r) == text


def test_reached_text_names_the_canary_and_what_moved() -> None:
    assert table.reached_text(Deltas()) == "canary 0"
    assert table.reached_text(Deltas(d_refused=1, too_large=1, probes="backend probes D 2 P 2")) \
        == "canary 0, D refused +1, proxy 413 +1, backend probes D 2 P 2"
    assert table.reached_text(Deltas(dropped=1, proxy_refused=2, too_large=1), "sidecar") == \
        "canary 0, sidecar dropped +1, sidecar refused +2, sidecar 413 +1"


# ------------------------------------------------------------------------------ expectations
def test_unmet_names_a_wrong_param_and_counters_that_did_not_move_as_expected() -> None:
    want = {"expect_param": "vllm_xargs.kv_transfer_params"}
    r = Row("s1", "x", "sidecar", "x", Answer(400, "m", param="vllm_xargs"), **want)
    assert table.unmet(r) == ["param vllm_xargs, expected vllm_xargs.kv_transfer_params"]
    r = Row("s1", "x", "sidecar", "x", Answer(400, "m"), **want)
    assert table.unmet(r) == ["param -, expected vllm_xargs.kv_transfer_params"]
    r = Row("s1", "x", "sidecar", "x", Answer(400, "m", param=want["expect_param"]), **want)
    assert table.unmet(r) == []
    r = row(200, "sidecar", expect_moved=(("dropped", 1), ("canary", 0)))
    assert table.unmet(r) == ["sidecar dropped +0, expected +1"]
    r = row(200, "sidecar", deltas=Deltas(dropped=1, canary=2),
            expect_moved=(("dropped", 1), ("canary", 0)))
    assert table.unmet(r) == ["canary +2, expected +0"]
    assert table.unmet(row(200, "public", expect_moved=(("too_large", 1),))) == \
        ["proxy 413 +0, expected +1"]


def test_format_row_marks_what_a_row_did_not_meet() -> None:
    line = table.format_row(row(200, "sidecar", expect=(200,), expect_moved=(("dropped", 1),)))
    assert line.endswith("canary 0; !sidecar dropped +0, expected +1"), line
    assert " sidecar " in line and "!200" not in line
    met = row(200, "sidecar", deltas=Deltas(dropped=1), expect_moved=(("dropped", 1),))
    assert table.format_row(met).endswith("canary 0, sidecar dropped +1")


# ------------------------------------------------------------------------------ rows
def test_format_row_is_one_line_with_every_column() -> None:
    r = row(400, "decode", key="4", name="vllm_xargs params a string",
            sent='vllm_xargs.kv_transfer_params="x"', message="[vllm_xargs] must not be set",
            deltas=Deltas(d_refused=1), honest_ok=True, expect=(200, 400),
            before=50 * 1024, after=51 * 1024, peak=53 * 1024, cpu_s=0.25)
    line = table.format_row(r)
    assert "\n" not in line
    for part in ("  4 ", "D vLLM port", 'vllm_xargs.kv_transfer_params="x"', " 400 ",
                 "[vllm_xargs] must not be set", "refused 400", " ok ",
                 "50.0->51.0 (+3.0) cpu 0.25s", "canary 0, D refused +1"):
        assert part in line, (part, line)
    assert "!" not in line


def test_format_row_marks_an_unexpected_status_and_a_streamed_bodys_bytes() -> None:
    r = Row("8", "200 MB body", "public", "CL 200 MB", Answer(200, "(served)", 200 << 20),
            expect=(413,), honest_ok=False)
    line = table.format_row(r)
    assert " !200 " in line and "[200 MB out]" in line and " FAIL " in line
    assert " - " in table.format_row(Row("9", "x", "public", "x", Answer(None, "")))


def test_rss_growth_is_the_peak_or_end_over_before() -> None:
    assert row(before=100 * 1024, after=101 * 1024, peak=130 * 1024).rss_growth_mb == 30.0
    assert row(before=100 * 1024, after=104 * 1024, peak=0).rss_growth_mb == 4.0
    assert row(before=100 * 1024, after=90 * 1024, peak=95 * 1024).rss_growth_mb == 0.0


# ------------------------------------------------------------------------------ summary
def test_summary_line_counts_and_format() -> None:
    rows = [row(400), row(200, deltas=Deltas(dropped=1)), row(None),
            row(200, "decode", deltas=Deltas(canary=1)), row(503),
            row(400, before=10 * 1024, after=10 * 1024, peak=22 * 1024)]
    s = table.summarize(rows, leaked_blocks=2)
    line = table.summary_line(s)
    m = SUMMARY.match(line)
    assert m, line
    assert line == ("summary cases=6 refused=3 reached_engine=1 engine_errors=1 "
                    "leaked_blocks=2 max_rss_growth_mb=12.0")
    assert table.exit_status(s) == 1


def test_late_uses_add_one_reached_engine() -> None:
    assert table.summarize([row(400)], 0, late_uses=3).reached_engine == 1
    assert table.summarize([], 0).max_rss_growth_mb == 0.0


@pytest.mark.parametrize(("change", "status"), [
    ({}, 0),
    ({"reached_engine": 1}, 1),
    ({"engine_errors": 1}, 1),
    ({"leaked_blocks": 1}, 1),
    ({"max_rss_growth_mb": 19.9}, 0),
    ({"max_rss_growth_mb": 20.0}, 1),
    ({"refused": 0}, 0),  # a case that got no answer does not fail the run by itself
])
def test_exit_status(change: dict[str, Any], status: int) -> None:
    base = {"cases": 3, "refused": 3, "reached_engine": 0, "engine_errors": 0,
            "leaked_blocks": 0, "max_rss_growth_mb": 1.0}
    assert table.exit_status(table.Summary(**{**base, **change})) == status


# ------------------------------------------------------------------------------ the cases
def fake_ctx(tmp_path: Path) -> Any:
    canary = SimpleNamespace(url="http://127.0.0.1:9", port=9)
    return probes.Context(public="http://127.0.0.1:1", control="http://127.0.0.1:2",
                     decode="http://127.0.0.1:3", prefill="http://127.0.0.1:4",
                     canary=canary, proxy_pid=os.getpid(), model="tiny",  # type: ignore[arg-type]
                     decode_kv_port=5, logs=tmp_path, sidecar="http://127.0.0.1:6",
                     sidecar_control="http://127.0.0.1:7", sidecar_pid=os.getpid())


def test_the_cases_cover_the_brief_and_send_nothing_when_built(tmp_path: Path) -> None:
    built = cases.build_cases(fake_ctx(tmp_path))
    keys = [c.key for c in built]
    assert len(set(keys)) == len(keys)
    for k in ("1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12a", "12b", "12c",
              "13", "14", "s1", "s2", "s3", "s4", "s5", "s6", "s7"):
        assert k in keys
    assert all(c.target in table.TARGETS and c.expect for c in built)
    by = {c.key: c for c in built}
    assert by["4"].target == "decode" and by["5"].target == "prefill"
    assert by["12a"].expect == (401,) and by["8"].expect == (413,)
    # the default start mode's edges: P's fetch of D's params, and ahead params sent to P
    assert by["12e"].expect == by["12f"].expect == (401,) and by["13c"].expect == (401, 413)
    assert by["7c"].target == "prefill"


def test_forged_ahead_params_aim_p_s_fetch_at_the_canary_and_are_not_signed() -> None:
    from lw.contract.ahead import decode_ahead_params
    from lw.contract.params import ContractError

    params = cases.forged_ahead_params("http://127.0.0.1:9")
    assert params["lw_ahead_url"] == "http://127.0.0.1:9/v1/ahead" and params["lw_ahead_compute"]
    with pytest.raises(ContractError):
        decode_ahead_params(b"k" * 32, params)


def test_the_sidecar_cases_expect_the_brief(tmp_path: Path) -> None:
    by = {c.key: c for c in cases.build_cases(fake_ctx(tmp_path))}
    side = [k for k, c in by.items() if c.target == "sidecar"]
    assert side == ["s1", "s2", "s3", "s4", "s5", "s6", "s7"]
    assert by["s1"].expect == (400,) and by["s1"].param == "vllm_xargs.kv_transfer_params"
    assert 200 in by["s2"].expect and 400 in by["s2"].expect
    assert by["s3"].expect == by["s4"].expect == (400,) and by["s5"].expect == (403,)
    assert by["s6"].moved == (("dropped", 1),) and by["s7"].expect == (413,)
    for k in ("s2", "s3", "s4", "s5"):
        assert ("canary", 0) in by[k].moved
    assert by["s3"].sent.endswith(": @127.0.0.1:9") and ":pw@127.0.0.1:9" in by["s4"].sent


def test_the_sidecar_cases_send_to_the_sidecar(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[str, Any, Any]] = []

    def fake_post(url: str, body: Any, headers: Any = None, timeout: float = 0) -> Answer:
        sent.append((url, body, headers))
        return Answer(400)

    def fake_stream(url: str, total: int, *, declare: bool, **kw: Any) -> Answer:
        sent.append((url, (total, declare), None))
        return Answer(413)

    monkeypatch.setattr(cases, "post", fake_post)
    monkeypatch.setattr(cases, "post_stream", fake_stream)
    ctx = fake_ctx(tmp_path)
    by = {c.key: c for c in cases.build_cases(ctx)}
    for k in ("s1", "s2", "s3", "s4", "s5", "s6", "s7"):
        by[k].send(ctx)
    got = dict(zip(["s1", "s2", "s3", "s4", "s5", "s6", "s7"], sent, strict=True))
    comp = "http://127.0.0.1:6/v1/completions"
    assert all(url == comp for k, (url, _, _) in got.items() if k != "s6")
    assert got["s1"][1]["vllm_xargs"] == {"kv_transfer_params": "x"}
    assert got["s2"][1]["stream"] is None
    assert got["s2"][1]["kv_transfer_params"]["metaserver"] == "http://127.0.0.1:9/steal"
    assert got["s3"][2] == {"x-prefiller-host-port": "@127.0.0.1:9"}
    assert got["s4"][2] == {"x-prefiller-host-port": ":pw@127.0.0.1:9"}
    assert got["s5"][2] == {"x-prefiller-host-port": "127.0.0.1:9"}
    for k in ("s3", "s4", "s5"):  # only the header is hostile
        assert not {"kv_transfer_params", "vllm_xargs"} & set(got[k][1])
    url, body, _ = got["s6"]
    assert url == "http://127.0.0.1:6/tokenize" and "kv_transfer_params" in body
    assert got["s7"][1] == (200 * table.MB, True)


def test_the_sidecar_allows_only_the_clusters_prefill_server() -> None:
    argv = run.sidecar_argv("http://127.0.0.1:3", "http://127.0.0.1:4", 6, 7)
    assert argv[1:4] == ["-m", "lw.proxy.server", "--sidecar"]
    pairs = dict(zip(argv[4::2], argv[5::2], strict=True))  # after --sidecar: pairs
    assert argv.count("--allow-prefiller") == 1 and argv.count("--decode") == 1
    assert "--prefill" not in argv and "--allow-any-prefiller" not in argv
    assert pairs["--decode"] == "http://127.0.0.1:3"
    assert pairs["--allow-prefiller"] == "127.0.0.1:4"
    assert (pairs["--port"], pairs["--control-port"]) == ("6", "7")
    # the proxy's own parser takes it (sidecar mode, one decode server, the allowlist)
    from lw.proxy.sidecar import parse_allow

    assert parse_allow(pairs["--allow-prefiller"]).admits("127.0.0.1", 4)
    assert not parse_allow(pairs["--allow-prefiller"]).admits("127.0.0.1", 9)


def test_hostile_bodies_name_the_canary(tmp_path: Path) -> None:
    body = cases.ssrf_body("tiny", "http://127.0.0.1:9")
    assert body["kv_transfer_params"]["metaserver"] == "http://127.0.0.1:9/steal"
    assert body["stream"] is None and body["prompt"] == "hello there friend"
    assert "kv_transfer_params" in cases.ssrf_body("tiny", "http://c:1", True)["vllm_xargs"]
    fp = cases.forged_prefill_params(list(range(40)), "127.0.0.1", 9)
    assert fp["remote_block_ids"] == [1, 2] and fp["remote_port"] == 9
    assert fp["do_remote_decode"] is True and fp["lw_sig"] == "0" * 64
    meta = cases.metaserver_body("http://127.0.0.1:9")
    assert meta["kv_transfer_params"]["remote_port"] == 9


def test_hand_written_bodies_spell_the_field_another_way() -> None:
    esc = cases.escaped_name_body("tiny", "http://127.0.0.1:9")
    assert b"kv_transfer_params" not in esc and b"kv_transfer_param\\u0073" in esc
    assert json.loads(esc)["kv_transfer_params"]["metaserver"] == "http://127.0.0.1:9/steal"
    dup = cases.duplicate_key_body("tiny", "http://127.0.0.1:9")
    assert dup.count(b'"kv_transfer_params"') == 2 and b"/steal" in dup
    assert json.loads(dup)["kv_transfer_params"] is None  # Python's parser: the last one wins


def test_a_row_sent_to_an_engine_shows_its_api_servers_growth() -> None:
    line = table.format_row(row(413, "decode", engine_rss_mb=64.5))
    assert line.endswith("canary 0, D API server RSS +64.5 MB")


def test_canary_records_connections_and_requests() -> None:
    import httpx

    c = probes.Canary()
    c.start()
    try:
        r = httpx.post(c.url + "/steal", json={"a": 1}, timeout=5)
        assert r.status_code == 418
        assert c.count() == 1 and c.requests == [("POST", "/steal", 7)]
    finally:
        c.stop()


def test_process_figures_of_this_process() -> None:
    assert probes.rss_kb(os.getpid()) > 0 and probes.cpu_s(os.getpid()) > 0
    assert probes.rss_kb(2 ** 30) == 0 and probes.cpu_s(2 ** 30) == 0.0


def test_lw_hostile_is_registered() -> None:
    module, _ = COMMANDS["hostile"]
    assert module == "lw.lab.hostile" and callable(hostile.main)
