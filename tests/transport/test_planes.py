"""Which data planes D can fence is stated once (lw.transport.dataplane.planes): the checker's
plane models, the synthetic cluster and the vLLM adapter's D settings follow it."""

from __future__ import annotations

import pytest

from lw.lab.synthetic.config import DATA_PLANES, FENCED_PLANES
from lw.sim.config import PLANES
from lw.transport.dataplane.planes import PLANE_NAMES, can_fence


def test_only_mooncake_over_tcp_has_a_fence() -> None:
    assert [p for p in PLANE_NAMES if can_fence(p)] == ["mooncake"]
    assert not can_fence("mooncake", "rdma")
    assert not can_fence("mooncake", "tcp", device="mlx5_0")
    assert can_fence("mooncake", " TCP ")


def test_an_unknown_plane_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown data plane 'ucx'"):
        can_fence("ucx")


def test_the_checkers_plane_models_agree() -> None:
    """A plane the checker models with a fence is one D can fence, and the other way round."""
    assert set(PLANES) <= set(PLANE_NAMES)
    assert {n: m.fence for n, m in PLANES.items()} == {n: can_fence(n) for n in PLANES}


def test_the_synthetic_cluster_fences_where_the_plane_can() -> None:
    assert DATA_PLANES == PLANE_NAMES
    assert frozenset(p for p in PLANE_NAMES if can_fence(p)) == FENCED_PLANES


@pytest.mark.parametrize(("extra", "fence"), [
    ({"mooncake_protocol": "tcp"}, True), ({"mooncake_protocol": "RDMA"}, False),
    ({"mooncake_device": "mlx5_0"}, False)], ids=["tcp", "rdma", "device"])
def test_the_vllm_adapters_d_fences_where_the_plane_can(extra: dict[str, str],
                                                         fence: bool) -> None:
    """(NIXL's D is lease-only: tests/vllm_adapter/test_nixl_config.py.)"""
    from lw.vllm_adapter.config import LwConfig

    cfg = LwConfig.build(role="kv_consumer", engine_id="e", kv_port=14579, tp_size=1,
                         pp_size=1, dp_size=1, dp_rank=0, load_failure_policy="fail",
                         extra={"host": "127.0.0.1", "data_plane": "mooncake", **extra})
    assert cfg.decode_config().fence_data is fence
