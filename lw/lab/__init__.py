"""lw's lab: demos, the local cluster, the tiny model, the oracle, the synthetic engine."""
