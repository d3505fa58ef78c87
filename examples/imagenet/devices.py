"""Simulated CPU devices, so that data parallelism runs on a machine without accelerators."""

import logging
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


def quiet_backend_probe() -> None:
  """Hides JAX's INFO line for each accelerator backend it looks for and does not find.

  On a machine without TPUs JAX logs "Unable to initialize backend 'tpu'" at
  INFO, which absl's ``app.run`` shows: a fact about the machine, not about
  the run. Warnings and errors of the same logger still show.
  """
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
