"""Hypothesis profiles of the model tests: "sim-ci" (default) and "sim-fuzz".

Chosen with LW_SIM_PROFILE=ci|fuzz and applied to the sim tests only (``sim_settings``), never
loaded globally, so other test folders keep their defaults. The long, time-boxed fuzz with the
same properties is ``lw check --mode random --faults --seconds N``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.filter_too_much],
               derandomize=False)

settings.register_profile("sim-ci", max_examples=150, stateful_step_count=60, **_COMMON)
settings.register_profile("sim-fuzz", max_examples=3000, stateful_step_count=200, **_COMMON)


def sim_settings() -> settings:
    """The profile chosen by LW_SIM_PROFILE (default "ci")."""
    return settings.get_profile("sim-" + os.environ.get("LW_SIM_PROFILE", "ci"))
