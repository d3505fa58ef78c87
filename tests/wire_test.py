"""Tests of the bytes of a switched program: each branch's (wire_bytes_by_branch), and a run's
sum of the branches its steps took (accumulate_stats)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsgd_jax

AXIS = "batch"
NUM_DEVICES = 4
_DEVICES = jax.devices()[:NUM_DEVICES]

_SWITCHED_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %sum = f32[] add(%a, %a)
}

%warm (p: (f32[1024])) -> (f32[1024]) {
  %x = f32[1024]{0} get-tuple-element(%p), index=0
  %ar = f32[1024]{0} all-reduce(%x), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %t = (f32[1024]{0}) tuple(%ar)
}

%inner_a (p: (u8[256])) -> (u8[256]) {
  %x = u8[256]{0} get-tuple-element(%p), index=0
  %ag = u8[256]{0} all-gather(%x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %t = (u8[256]{0}) tuple(%ag)
}

%inner_b (p: (u8[256])) -> (u8[256]) {
  ROOT %p2 = (u8[256]) parameter(0)
}

%packed (p: (f32[1024])) -> (f32[1024]) {
  %x = f32[1024]{0} get-tuple-element(%p), index=0
  %codes = u32[32]{0} all-to-all(%y), replica_groups={}, dimensions={0}
  %nested = (u8[256]{0}) conditional(%q, %z, %z), branch_computations={%inner_a, %inner_b}
  ROOT %t = (f32[1024]{0}) tuple(%x)
}

%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %cp = f32[16]{0} collective-permute(%v), source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], f32[16]) tuple(%i, %cp)
}

%cond (p: (s32[], f32[16])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (p0: f32[1024], p1: pred[]) -> f32[1024] {
  %metrics = f32[2]{0} all-reduce(%m), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %switch = (f32[1024]) conditional(%p1, %t, %t), true_computation=%warm, false_computation=%packed
  %loop = (s32[], f32[16]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1024]{0} get-tuple-element(%switch), index=0
}
"""


def test_each_branch_of_a_conditional_counts_apart():
  by_branch = qsgd_jax.wire_bytes_by_branch(_SWITCHED_HLO)
  ring = 2 * 7 / 8
  metrics, loop = ring * 8, 16 * 4  # The loop body's collective-permute, counted once.
  warm_up = ring * 4096
  compressed = 7 / 8 * 128 + 7 / 8 * 256  # Its all-to-all, and its nested conditional's sum.
  assert by_branch.unconditional == pytest.approx(metrics + loop)
  # (false, true): the branch index of a pred conditional, as jax.lax.cond's (false_fun, true_fun).
  assert by_branch.conditionals[0] == pytest.approx((compressed, warm_up))
  assert len(by_branch.conditionals) == 1
  assert by_branch.sent(1) == pytest.approx(metrics + loop + warm_up)
  # A step's fewest bytes take the nested conditional's branch that sends nothing.
  assert by_branch.least == pytest.approx(metrics + loop + 7 / 8 * 128)
  assert by_branch.most == pytest.approx(metrics + loop + warm_up)
  # wire_bytes sums every branch.
  assert qsgd_jax.wire_bytes(_SWITCHED_HLO) == pytest.approx(
      by_branch.unconditional + compressed + warm_up)
  with pytest.raises(ValueError, match="one branch a conditional: this program has 1, got 2"):
    by_branch.sent(0, 1)


def _steps(tx, params, grads, num_steps):
  """``num_steps`` pmapped updates: the last state, the run's summed stats and the HLO."""
  state = jax.pmap(tx.init, AXIS, devices=_DEVICES)(params)
  step = jax.pmap(tx.update, AXIS, devices=_DEVICES)
  run, per_step = None, []
  for _ in range(num_steps):
    _, state = jax.block_until_ready(step(grads, state, params))
    run = qsgd_jax.accumulate_stats(run, state)
    per_step.append(float(qsgd_jax.compression_stats(state).wire_bits[0]) / 8)
  return run, per_step, step.lower(grads, state, params).compile().as_text()


@pytest.mark.parametrize("make, switch", [
    (lambda: qsgd_jax.onebit_adam(1e-3, AXIS, freeze_step=2), 2),
    (lambda: optax.chain(qsgd_jax.powersgd(AXIS, rank=2, start_iter=2), optax.sgd(0.1)), 2),
])
def test_a_run_counts_the_branch_each_step_took(make, switch):
  n = NUM_DEVICES
  rng = np.random.default_rng(0)
  params = [jnp.zeros((n, 256, 128)), jnp.zeros((n, 128))]
  grads = [jnp.asarray(rng.normal(size=(n, 256, 128)), jnp.float32),
           jnp.asarray(rng.normal(size=(n, 128)), jnp.float32)]
  run, per_step, hlo = _steps(make(), params, grads, num_steps=5)
  float32 = 2 * (n - 1) / n * 4 * (256 * 128 + 128)
  warm, compressed = per_step[0], per_step[-1]
  assert per_step == [warm] * switch + [compressed] * (5 - switch)
  assert warm == pytest.approx(float32) and compressed < float32 / 10
  assert int(run.steps[0]) == 5
  np.testing.assert_allclose(run.wire_bits / 8, switch * warm + (5 - switch) * compressed)
  np.testing.assert_allclose(run.float32_bits / 8, 5 * float32)
  np.testing.assert_allclose(run.compression_ratio, run.float32_bits / run.wire_bits)
  # The compiled step: both branches summed by wire_bytes, apart by wire_bytes_by_branch.
  by_branch = qsgd_jax.wire_bytes_by_branch(hlo)
  assert len(by_branch.conditionals) == 1
  assert sorted(by_branch.conditionals[0]) == [pytest.approx(compressed, rel=1e-6),
                                               pytest.approx(warm, rel=1e-6)]
  assert by_branch.unconditional == 0
  assert (by_branch.least, by_branch.most) == (pytest.approx(compressed, rel=1e-6),
                                               pytest.approx(warm, rel=1e-6))
  assert qsgd_jax.wire_bytes(hlo) == pytest.approx(warm + compressed, rel=1e-6)


def test_accumulate_stats_needs_stats():
  with pytest.raises(ValueError, match="no CompressionStats in ScaleByAdamState"):
    qsgd_jax.accumulate_stats(None, optax.adam(1e-3).init(jnp.zeros(3))[0])
