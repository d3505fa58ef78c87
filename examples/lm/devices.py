"""Simulated CPU devices, so that data parallelism runs on a machine without accelerators."""

import os

FLAG = "--xla_force_host_platform_device_count"


def simulate_cpu_devices(count: int = 8) -> None:
  """Asks XLA for ``count`` CPU devices, unless ``XLA_FLAGS`` already sets a number.

  It must run before JAX starts: call it before the first ``import jax``.
  Accelerators are unaffected; the CPU devices are only used where there are none.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}={count}".strip()
