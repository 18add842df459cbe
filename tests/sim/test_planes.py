"""Each data plane's measured semantics in the checker (issue 60): Mooncake over TCP has a
fence that holds, NIXL is lease-only; a fence that returns before a writer's bytes stop is
caught."""

from __future__ import annotations

import pytest

from lw.sim.cli import main, strong_configs
from lw.sim.config import PLANES, WorldConfig
from lw.sim.explorer import explore
from lw.sim.variants import DESIGNS

LATE = DESIGNS["lease-only-fence"].config_overrides()  # an in-doubt write, late bytes, 2 requests


def test_only_a_plane_with_a_fence_fences() -> None:
    assert WorldConfig().decode_config().fence_data
    nixl = WorldConfig(data_plane="nixl")
    assert not nixl.fences() and not nixl.decode_config().fence_data
    assert nixl.quarantine_s() == nixl.lease_s  # the lease alone
    assert PLANES["mooncake"].fence_holds and not PLANES["nixl"].fence
    with pytest.raises(ValueError, match="unknown data plane"):
        WorldConfig(data_plane="rdma")


def test_nixl_lease_only_is_safe_only_while_late_bytes_land_within_the_lease() -> None:
    """With in-doubt bytes bounded by the transfer timeout, the lease covers them; unbounded
    (late writes), NIXL's lease is the lease-frees-in-flight counterexample: why NIXL needs a
    fence that holds before it is run where bytes can come later than the lease."""
    bounded = explore(WorldConfig(**{**LATE, "late_writes": False, "data_plane": "nixl"}),
                      max_seconds=60, check_cycles=True)
    assert bounded.counterexample is None and bounded.complete
    late = explore(WorldConfig(**{**LATE, "data_plane": "nixl"}), max_seconds=60)
    assert late.counterexample is not None and late.counterexample.violation.prop == "stale-kv"
    assert any(a[0] == "zland" for a in late.counterexample.actions)


def test_a_fence_that_returns_early_is_caught_where_the_real_one_holds() -> None:
    design = DESIGNS["fence-returns-early"]
    cfg = WorldConfig(design=design.name, **design.config_overrides())
    assert cfg.fences() and not cfg.fence_holds()
    ce = explore(cfg, max_seconds=60).counterexample
    assert ce is not None and ce.violation.prop == "stale-kv"
    kinds = [a[0] for a in ce.actions]
    assert "fenced" in kinds and kinds[-1] == "zland"  # it landed after the fence returned
    assert kinds.index("fenced") < kinds.index("zland")
    # its bounds are among the strong check's, where d-first (Mooncake's fence) holds
    assert any(kw == design.config_overrides() for _label, kw in strong_configs("d-first"))


def test_the_strong_check_runs_both_planes() -> None:
    planes = {kw.get("data_plane", "mooncake") for _label, kw in strong_configs("d-first")}
    assert planes == set(PLANES)


def test_cli_says_nixl_is_lease_only(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--dp", "1", "--requests", "1", "--layers", "1", "--faults", "--fault-kinds",
            "write", "--no-delays", "--data-plane", "nixl"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "data plane NIXL (UCX over TCP) (lease only: no fence)" in out
    assert "fences: none" in out and "has no fence" in out
