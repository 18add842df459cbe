"""The D-first proxy process: routing, control plane, failover, sidecar, passthrough."""
