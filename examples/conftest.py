"""Test set-up for the examples, fixed before JAX starts: eight simulated CPU devices, and
programs compiled without most of XLA's optimizations (see tests/conftest.py)."""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")
