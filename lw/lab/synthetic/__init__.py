"""A synthetic P/D engine: DP ranks in lock step over numpy KV caches, a decoder that verifies."""

from lw.lab.synthetic.cluster import run_cluster
from lw.lab.synthetic.config import FAULTS, ClusterConfig, canonical_fault
from lw.lab.synthetic.result import ClusterResult

__all__ = ["FAULTS", "ClusterConfig", "ClusterResult", "canonical_fault", "run_cluster"]
