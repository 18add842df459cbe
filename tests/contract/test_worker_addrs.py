"""Worker addresses a proxy learns from its traffic (``lw status --proxy``)."""

from __future__ import annotations

from lw.contract.worker_addrs import KnownWorkers, decode_workers, worker_addrs


def test_an_engines_tp_ranks_listen_on_consecutive_ports() -> None:
    assert worker_addrs("10.0.0.2", 5600, 2) == ["tcp://10.0.0.2:5600", "tcp://10.0.0.2:5601"]
    assert worker_addrs("fe80::1", 5600, 1) == ["tcp://[fe80::1]:5600"]


def test_decode_workers_come_from_a_metaserver_calls_params() -> None:
    params = {"remote_host": "10.0.0.2", "remote_port": 5600, "remote_tp_size": 2}
    assert decode_workers(params) == ["tcp://10.0.0.2:5600", "tcp://10.0.0.2:5601"]
    for bad in (None, [], {}, {**params, "remote_port": "5600"}, {**params, "remote_tp_size": 0},
                {**params, "remote_port": 65535}, {**params, "remote_host": "a b"},
                {**params, "remote_tp_size": True}):
        assert decode_workers(bad) == [], bad


def test_known_workers_keep_well_formed_addresses_in_order_bounded() -> None:
    k = KnownWorkers(limit=3)
    assert k.learn("prefill", ["tcp://h:1", "tcp://h:1", "h:2", 5, "tcp://h:0",
                               "tcp://h:70000", "tcp://[::1]:3"]) == 2
    assert k.learn("prefill", "tcp://h:9") == 0  # not a list
    assert k.learn("decode", ["tcp://d:1"]) == 1
    assert k.learn("prefill", ["tcp://h:4", "tcp://h:5"]) == 1  # the bound
    assert k.snapshot() == {"prefill": ["tcp://h:1", "tcp://[::1]:3", "tcp://h:4"],
                            "decode": ["tcp://d:1"]}
