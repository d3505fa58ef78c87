"""Quantized pmean across two processes of 4 CPU devices each, over gloo.

The two processes run ``multiprocess_worker.py`` on localhost; this test
checks that every one of the 8 devices, in both processes, ends with the same
bits, that those bits are the ones one process of 8 devices computes, and that
they are close to the exact mean.
"""

import importlib.util
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

_WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
_spec = importlib.util.spec_from_file_location("multiprocess_worker", _WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)
_TIMEOUT_SECONDS = 120
_DEVICES_A_PROCESS = 4


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def _child_environment() -> dict[str, str]:
  flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
           if not flag.startswith("--xla_force_host_platform_device_count")]
  flags.append(f"--xla_force_host_platform_device_count={_DEVICES_A_PROCESS}")
  return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")


def _run_workers(directory: pathlib.Path, meanwhile):
  """Starts both processes, calls ``meanwhile()``, waits, and loads what each saved."""
  port = _free_port()
  processes, logs = [], []
  try:
    for process_id in range(worker.NUM_PROCESSES):
      log = directory / f"worker{process_id}.log"
      logs.append(log)
      with open(log, "wb") as stream:
        processes.append(subprocess.Popen(
            [sys.executable, str(_WORKER), str(process_id), str(port),
             str(directory / f"worker{process_id}.npz")],
            stdout=stream, stderr=subprocess.STDOUT, env=_child_environment(),
        ))
    deadline = time.monotonic() + _TIMEOUT_SECONDS
    also = meanwhile()
    for process, log in zip(processes, logs, strict=True):
      try:
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pytest.fail(f"worker still running after {_TIMEOUT_SECONDS} s:\n"
                    f"{log.read_text(errors='replace')[-3000:]}")
      assert process.returncode == 0, log.read_text(errors="replace")[-3000:]
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
  saved = [dict(np.load(directory / f"worker{i}.npz")) for i in range(worker.NUM_PROCESSES)]
  return saved, also


@pytest.mark.slow
def test_two_processes_agree_bit_for_bit_and_match_one_process(tmp_path):
  num_devices = worker.NUM_PROCESSES * _DEVICES_A_PROCESS
  inputs = worker.global_inputs(num_devices)

  def in_this_process():
    """The same computation here, on this process's 8 simulated devices."""
    out = jax.pmap(worker.mean_of_both_methods, axis_name=worker.AXIS)(inputs)
    return jax.tree.map(np.asarray, jax.block_until_ready(out))

  results, single = _run_workers(tmp_path, in_this_process)

  # The pmap spanned all 8 devices of both processes.
  indices = np.concatenate([r["['axis_index']"] for r in results])
  assert sorted(indices.tolist()) == list(range(num_devices))
  assert all(np.all(r["['axis_size']"] == num_devices) for r in results)

  exact = {name: x.astype(np.float64).mean(axis=0) for name, x in inputs.items()}
  for method in ("two_phase", "psum"):
    for leaf in ("kernel", "bias"):
      name = f"['{method}']['{leaf}']"
      rows = np.concatenate([r[name] for r in results])
      assert rows.shape == (num_devices, *exact[leaf].shape)
      for row in rows:
        np.testing.assert_array_equal(row, rows[0])
      if leaf == "kernel":
        # Codes only move between devices (two_phase) or add as integers
        # (psum): the bits cannot depend on how many processes there are.
        np.testing.assert_array_equal(rows[0], single[method][leaf][0])
        error = np.linalg.norm(rows[0] - exact[leaf]) / np.linalg.norm(exact[leaf])
        assert error < 0.02, (method, error)
      else:
        # The float32 psum of small leaves may add in another order over gloo.
        np.testing.assert_allclose(rows[0], exact[leaf], rtol=1e-6, atol=1e-7)
