"""LocalCluster mounts lw's admission guard on lw's engines only: on an engine of vLLM's own
connector (the serving benchmark's peer) it refused every request as "contract version None".
Its data plane reaches P's and D's config, with UCX's settings for NIXL; no engines start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lw.lab.local_cluster import (
    ADMISSION,
    LocalCluster,
    Server,
    in_multi_connector,
    is_lw_connector,
    kv_transfer_config,
    lw_data_plane,
)

MOONCAKE = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "engine_id": "p",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}


def test_the_guard_is_mounted_on_lw_engines_only(tmp_path: Path) -> None:
    lw = kv_transfer_config("kv_producer", 5600, "prefill")
    cluster = LocalCluster(model=tmp_path, workdir=tmp_path)
    for kv, guarded in ((lw, True), (in_multi_connector(lw), True), (MOONCAKE, False),
                        (in_multi_connector(MOONCAKE), False), (None, False)):
        assert is_lw_connector(kv) is guarded, kv
        argv = cluster._engine("prefill", 0, kv).argv
        assert (ADMISSION in argv) is guarded, argv
        assert ("--kv-transfer-config" in argv) is (kv is not None)


def _started_without_processes(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cluster.start()`` with every server built but none spawned, waited on or warmed."""
    from lw.lab import local_cluster

    monkeypatch.setattr(local_cluster.Server, "start", lambda self: None)
    monkeypatch.setattr(local_cluster, "wait_ready", lambda servers, timeout: None)
    monkeypatch.setattr(LocalCluster, "warm_up", lambda self, timeout: None)
    monkeypatch.setattr(LocalCluster, "start_proxy", lambda self, timeout=60.0: None)
    cluster.start()


def _extra(server: Server) -> dict[str, Any]:
    kv = json.loads(server.argv[server.argv.index("--kv-transfer-config") + 1])
    return dict(kv["kv_connector_extra_config"])


def test_nixl_goes_to_both_sides_with_ucx_over_tcp_on_loopback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    cluster = LocalCluster(model=tmp_path, workdir=tmp_path, data_plane="nixl")
    _started_without_processes(cluster, monkeypatch)
    for name in ("prefill", "decode"):
        s = cluster.servers[name]
        assert _extra(s)["data_plane"] == "nixl"
        assert (s.env["UCX_TLS"], s.env["UCX_NET_DEVICES"]) == ("tcp", "lo")
    assert "UCX_TLS" not in cluster.servers["reference"].env  # no connector, no UCX
    assert lw_data_plane(in_multi_connector(kv_transfer_config(
        "kv_producer", 1, "p", {"data_plane": "nixl"}))) == "nixl"
    assert lw_data_plane(MOONCAKE) is None


def test_mooncake_stays_the_default_and_the_users_ucx_settings_win(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "rc,tcp")
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    cluster = LocalCluster(model=tmp_path, workdir=tmp_path)
    _started_without_processes(cluster, monkeypatch)
    assert _extra(cluster.servers["decode"])["data_plane"] == "mooncake"
    assert "UCX_NET_DEVICES" not in cluster.servers["decode"].env
    nixl = LocalCluster(model=tmp_path, workdir=tmp_path / "n", data_plane="nixl")
    assert nixl.ucx_env("prefill") == {"UCX_NET_DEVICES": "lo"}


def test_ucx_takes_the_interface_of_ds_address_inside_its_namespace(tmp_path: Path) -> None:
    """D in a network namespace: the interface holding its address there (not this side's)."""
    from lw.lab.synthetic import netns

    why = netns.unavailable()
    if why:
        pytest.skip(why)
    ns, dev, addr = f"lwt-ucx-{os.getpid()}", "lwtucx0", "10.79.251.2"
    netns.run_ip("netns", "add", ns)
    try:
        # a veth pair whose ends have different names: only the namespace's holds ``addr``
        netns.run_ip("link", "add", dev + "r", "type", "veth", "peer", "name", dev, "netns", ns)
        netns.run_ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        cluster = LocalCluster(model=tmp_path, workdir=tmp_path, data_plane="nixl",
                               hosts={"decode": addr}, netns={"decode": ns})
        if "UCX_NET_DEVICES" not in os.environ:
            assert cluster.ucx_env("decode")["UCX_NET_DEVICES"] == dev
    finally:
        netns.run_ip("link", "del", dev + "r", check=False)
        netns.run_ip("netns", "del", ns, check=False)


@pytest.mark.parametrize("own", [True, False])
def test_a_server_in_the_callers_session_is_still_killed_with_its_children(
        tmp_path: Path, own: bool) -> None:
    """The demo keeps its servers in its own session (one autogroup: Server.own_session); a
    server's process group, its children included, still goes on stop either way."""
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
             "'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)"
    s = Server("x", [sys.executable, "-c", script], dict(os.environ), "http://127.0.0.1:9",
               tmp_path / "x.log", own_session=own)
    s.start()
    assert s.proc is not None
    for _ in range(100):
        if (tmp_path / "x.log").read_text().startswith("up"):
            break
        time.sleep(0.05)
    assert (os.getsid(s.proc.pid) == os.getsid(0)) is not own
    assert os.getpgid(s.proc.pid) == s.proc.pid
    pgid = s.proc.pid
    s.stop(timeout=5)
    left = "?"
    for _ in range(100):  # the orphaned child is reaped by init a moment later
        left = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
        if not left:
            break
        time.sleep(0.05)
    assert left == ""



def test_a_shared_reference_is_used_but_never_started_nor_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster given another's reference engine (the e2e modules' session one) serves it as
    its "reference" and leaves starting and stopping it to its owner."""
    from lw.lab import local_cluster

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(Server, "start", lambda self: calls.append(("start", self.name)))
    monkeypatch.setattr(Server, "stop",
                        lambda self, timeout=20.0: calls.append(("stop", self.name)))
    monkeypatch.setattr(local_cluster, "wait_ready",
                        lambda servers, timeout: calls.extend(("wait", s.name) for s in servers))
    monkeypatch.setattr(LocalCluster, "warm_up", lambda self, timeout: None)
    monkeypatch.setattr(LocalCluster, "start_proxy", lambda self, timeout=60.0: None)
    shared = LocalCluster(model=tmp_path, workdir=tmp_path).reference_engine()
    assert shared.name == "reference" and "--kv-transfer-config" not in shared.argv
    cluster = LocalCluster(model=tmp_path, workdir=tmp_path, shared_reference=shared)
    cluster.start()
    cluster.stop()
    assert cluster.servers["reference"] is shared and cluster.url("reference") == shared.url
    assert ("wait", "reference") in calls  # ready before the cluster is
    assert not {("start", "reference"), ("stop", "reference")} & set(calls), calls
    assert {("start", "decode"), ("stop", "decode"), ("stop", "prefill")} <= set(calls)
    calls.clear()
    own = LocalCluster(model=tmp_path, workdir=tmp_path)
    own.start()
    own.stop()
    assert {("start", "reference"), ("stop", "reference")} <= set(calls)
