"""Test set-up, fixed before JAX starts: eight simulated CPU devices, and programs compiled
without most of XLA's optimizations (as JAX's own tests can: the same results, compiled in
about a third less time; subprocesses inherit it). A test that needs XLA's full optimizations
says so with ``@pytest.mark.usefixtures("full_optimizations")``."""

import os

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")


@pytest.fixture
def full_optimizations():
  """XLA's full optimizations for one test, as users compile."""
  import jax

  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)
