"""Test set-up for the examples: eight simulated CPU devices, fixed before JAX starts, and
programs compiled without most of XLA's optimizations."""

import os

import pytest

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()


@pytest.fixture(autouse=True, scope="module")
def fast_compilation():
  """Compiles each test file's programs without most of XLA's optimizations, as JAX's own tests
  can: they compute the same, and compile in about a third less time. Subprocesses (the
  examples' ``main`` run as a program) compile as users' do."""
  import jax

  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)
