"""The synthetic cluster on the NIXL data plane (issue 60): engines as processes, UCX over TCP,
D lease-only; and the refusals of a plane that is not there."""

from __future__ import annotations

import pytest

from lw.lab import demo
from lw.lab.synthetic import ClusterConfig, run_cluster
from lw.lab.synthetic.workers import interface_of, ucx_env
from lw.transport.dataplane import nixl
from lw.transport.dataplane.nixl import nixl_missing

KEY = b"synthetic-cluster-key-0123456789"
# the smallest cluster that still crosses processes: one P rank, one decoder, a few requests
TINY = dict(requests=4, prefill_dp=1, layers=2, blocks_per_request=2, block_bytes=16 * 1024,
            d_blocks=8, p_blocks=8, layer_ms=1.0, cluster_key=KEY, run_timeout_s=60.0)


@pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing() or "")
def test_a_small_cluster_on_nixl_completes_every_request_and_leaks_nothing() -> None:
    cfg = ClusterConfig(**{**TINY, "data_plane": "nixl"})  # type: ignore[arg-type]
    assert cfg.decode_config().fence_data is False  # lease-only: nothing of lw's to cut
    res = run_cluster(cfg)
    assert not res.errors, (res.errors, res.log_dir)
    assert (res.done, res.failed, res.corrupt, res.leaked) == (4, 0, 0, 0), res.reasons
    assert res.bytes_moved == 4 * 2 * 2 * 16 * 1024
    assert res.ok


def test_an_unknown_data_plane_is_refused_naming_the_planes() -> None:
    with pytest.raises(ValueError, match="mooncake, nixl, inprocess"):
        ClusterConfig(data_plane="rdma")
    with pytest.raises(SystemExit) as exc:
        demo.main(["--engine", "synthetic", "--data-plane", "rdma"])
    assert exc.value.code == 2


def test_demo_on_nixl_without_nixl_names_the_extra_and_exits_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(nixl, "nixl_missing", lambda: "NIXL is not installed (pip install "
                        "'lw-layerwise[nixl]')")
    assert demo.main(["--engine", "synthetic", "--data-plane", "nixl", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "lw-layerwise[nixl]" in err and "--data-plane mooncake" in err


def test_ucx_runs_over_tcp_on_the_workers_interface_unless_the_user_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert interface_of("127.0.0.1") == "lo"
    assert ucx_env("127.0.0.1") == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    assert ucx_env("192.0.2.1") == {"UCX_TLS": "tcp"}  # held by no interface here
    monkeypatch.setenv("UCX_TLS", "rc,tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    assert ucx_env("127.0.0.1") == {}


def test_the_fault_table_names_the_plane_and_what_a_link_row_carried() -> None:
    """The title says NIXL's D is lease-only; a link row says the KV its plane landed, the rate
    and the bytes on the link, so a plane that carries nothing there is seen, not guessed."""
    from lw.lab.synthetic import ClusterResult

    cfg = ClusterConfig(**{**TINY, "data_plane": "nixl", "fault": "lossy-link"})  # type: ignore[arg-type]
    res = ClusterResult(cfg)
    res.bytes_moved, res.elapsed_s, res.counters["link.mib"] = 3 << 20, 20.0, 41
    assert "nixl data plane (lease-only: D's fence off)" in demo._table_header(cfg)
    assert "nixl carried 3.0 MiB of KV (0.15 MiB/s), the link 41 MiB" in demo._row(res)
    mooncake = ClusterConfig(**{**TINY, "fault": "none"})  # type: ignore[arg-type]
    assert demo._table_header(mooncake).startswith("lw demo: fault table, synthetic engine, "
                                                   "mooncake data plane\n")
    assert "carried" not in demo._row(ClusterResult(mooncake))
