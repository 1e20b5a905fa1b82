"""Update diagnostics: hand-worked values, empty kinds, and exact combination over micro-batches."""
import chex
import jax
import jax.numpy as jnp
import pytest

from jaxrlvr import diagnostics


def _case():
  # Row 0 fresh, A = +1, ratios (.5, 1, 1.5) and a masked 7. Row 1 fresh, A = -1, ratios (.5, 1, 4, 1).
  # Row 2 replayed, A = 0, ratios (2, .5) and two masked.
  ratios = jnp.array([[.5, 1., 1.5, 7.], [.5, 1., 4., 1.], [2., .5, 1., 1.]])
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], bool)
  return jnp.log(ratios), jnp.zeros((3, 4)), jnp.array([1., -1., 0.]), mask, jnp.array([False, False, True])


def test_hand_worked_diagnostics():
  logp, old, adv, mask, replayed = _case()
  m = diagnostics.policy_diagnostics(logp, old, adv, mask, replayed=replayed, dual_clip=3.)
  expected = {
      "tokens": 9.,  # 3 + 4 + 2
      "zero_adv_frac": 2 / 9,  # the replayed row has A = 0
      # 7 fresh tokens take the clip path: 1.5 with A > 0 (> 1.2), .5 with A < 0 (< .8), 4 with A < 0 (> c = 3).
      "clip_frac_high": 1 / 7, "clip_frac_low": 1 / 7, "dual_clip_frac": 1 / 7,
      "fresh/tokens": 7.,
      "fresh/ratio_mean": 9.5 / 7,  # (.5 + 1 + 1.5 + .5 + 1 + 4 + 1) / 7 = 1.357143
      # E[w^2] = 21.75 / 7 = 3.107143; var = 3.107143 - 1.357143^2 = 1.265306; std = 1.124858
      "fresh/ratio_std": 1.124858, "fresh/ratio_max": 4., "fresh/ratio_min": .5,
      # k3 = (w - 1) - ln w: .193147 * 2 + .094535 (1.5) + 1.613706 (4) = 2.094535, / 7 = .299219
      "fresh/approx_kl": .299219,
      # k1 = -ln w: 2 * .693147 - .405465 - 1.386294 = -.405465, / 7 = -.057924
      "fresh/approx_kl_k1": -.057924,
      "replayed/tokens": 2.,
      "replayed/ratio_mean": 1.25,  # (2 + .5) / 2; E[w^2] = 2.125, var = 2.125 - 1.5625 = .5625
      "replayed/ratio_std": .75, "replayed/ratio_max": 2., "replayed/ratio_min": .5,
      "replayed/approx_kl": .25,  # (.306853 + .193147) / 2
      "replayed/approx_kl_k1": 0.,  # (-ln 2 + ln 2) / 2
  }
  assert set(m) == set(expected)
  for key, value in expected.items():
    chex.assert_trees_all_close(m[key], jnp.float32(value), atol=2e-6, custom_message=key)


def test_replayed_on_the_clip_path_when_shaping_is_off_and_clip_off_counts_nothing():
  logp, old, adv, mask, replayed = _case()
  m = diagnostics.policy_diagnostics(logp, old, adv, mask, replayed=replayed, dual_clip=3., shaping_beta=None)
  # Now all 9 tokens take the clip path; the replayed ones have A = 0 and are never clipped: 1/9 each.
  chex.assert_trees_all_close((m["clip_frac_high"], m["clip_frac_low"], m["dual_clip_frac"]), (1 / 9,) * 3,
                              atol=1e-7)
  m = diagnostics.policy_diagnostics(logp, old, adv, mask, replayed=replayed, clip=False, dual_clip=3.)
  assert (float(m["clip_frac_high"]), float(m["clip_frac_low"]), float(m["dual_clip_frac"])) == (0., 0., 0.)


def test_no_tokens_of_a_kind_gives_zeros_not_nan():
  logp, old, adv, mask, _ = _case()
  m = diagnostics.policy_diagnostics(logp, old, adv, mask)  # no replayed tokens at all
  for key in ("tokens", "ratio_mean", "ratio_std", "ratio_max", "ratio_min", "approx_kl", "approx_kl_k1"):
    assert float(m[f"replayed/{key}"]) == 0., key
  m = diagnostics.policy_diagnostics(logp, old, adv, jnp.zeros_like(mask))  # no tokens at all
  assert all(bool(jnp.isfinite(v)) and float(v) == 0. for v in m.values()), m


def test_stats_combine_exactly_over_microbatches_under_scan_and_jit():
  logp, old, adv, mask, replayed = _case()
  kwargs = dict(replayed=replayed, dual_clip=3.)
  whole = diagnostics.policy_diagnostics(logp, old, adv, mask, **kwargs)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def scanned(lp, o, a, mk, rp):
    stats = lambda i: diagnostics.policy_stats(lp[i], o[i], a[i], mk[i], replayed=rp[i], dual_clip=3.)
    rows = jnp.arange(3)[:, None]  # three micro-batches of one row each: [3, 1]
    stacked = jax.lax.map(stats, rows)  # every stat gets a leading [3]
    carried = jax.lax.scan(lambda c, i: (diagnostics.merge_stats(c, stats(i)), None), diagnostics.empty_stats(),
                           rows)[0]
    return diagnostics.finalize_stats(diagnostics.reduce_stats(stacked)), diagnostics.finalize_stats(carried)

  reduced, merged = scanned(logp, old, adv, mask, replayed)
  scanned(logp * .5, old, adv, mask, replayed)  # same shapes: no second trace
  chex.assert_trees_all_close(reduced, whole, atol=1e-6)
  chex.assert_trees_all_close(merged, whole, atol=1e-6)
  with pytest.raises(ValueError, match="cannot merge stats"):
    diagnostics.merge_stats({"a": 1}, {"b": 1})


def test_diagnostics_carry_no_gradient():
  logp, old, adv, mask, replayed = _case()
  grad = jax.grad(lambda lp: diagnostics.policy_diagnostics(lp, old, adv, mask, replayed=replayed)["fresh/ratio_mean"])
  assert float(jnp.abs(grad(logp)).sum()) == 0.
