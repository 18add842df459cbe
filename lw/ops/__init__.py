"""Operating a running lw deployment: ``lw status`` (live requests, timelines, traces)."""
