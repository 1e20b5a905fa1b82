"""The pure loss functions, checked against numbers worked out by hand (see the comment beside each assertion)."""
import importlib
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlvr import objectives as obj

LN2 = math.log(2.0)


def _lw(ratios):
  """log-probs whose ratio to old_logp = 0 is `ratios` (up to float32 rounding)."""
  return jnp.log(jnp.asarray(ratios, jnp.float32))


def _exact_log(target: float) -> np.float32:
  """A float32 x with exp(x) == float32(target) exactly, in XLA and in torch: a ratio exactly on a clip edge."""
  torch = pytest.importorskip("torch")
  want = np.float32(target)
  x = np.float32(np.log(np.float64(want)))
  for step in range(64):
    for direction in (np.inf, -np.inf):
      c = x
      for _ in range(step):
        c = np.nextafter(c, np.float32(direction))
      if jnp.exp(jnp.float32(c)) == want and torch.exp(torch.tensor(c)).item() == want:
        return c
  raise AssertionError(f"no float32 log found for {target}")


# ----------------------------------------------------------------------------------------------------------------
# group_advantages, policy_shaping


def test_group_advantages_dr_grpo_and_std():
  rewards = jnp.array([[1., 0., 0., 1.], [1., 1., 1., 1.], [0., 0., 1., 0.]])
  # means 0.5, 1, 0.25 -> r - mean; the constant group gets 0.
  chex.assert_trees_all_close(obj.group_advantages(rewards),
                              jnp.array([[.5, -.5, -.5, .5], [0., 0., 0., 0.], [-.25, -.25, .75, -.25]]), atol=1e-7)
  # Unbiased std: group 0: sum (r - m)^2 = 4 * .25 = 1, / (K - 1 = 3) -> std .57735, .5 / .57735 = .866025;
  # group 2: .75 / 3 = .25 -> std .5 -> [-.5, -.5, 1.5, -.5]; constant group: 0 / (0 + eps) = 0.
  chex.assert_trees_all_close(obj.group_advantages(rewards, scale_by_std=True),
                              jnp.array([[.866025, -.866025, -.866025, .866025], [0., 0., 0., 0.],
                                         [-.5, -.5, 1.5, -.5]]), atol=2e-6)
  # Integer rewards come back as float32.
  assert obj.group_advantages(jnp.array([[1, 0]], jnp.int32)).dtype == jnp.float32


def test_group_advantages_mask_and_gradient_of_constant_group_is_finite():
  rewards = jnp.array([[1., 0., 0., 1.]])
  mask = jnp.array([[True, True, True, False]])
  # Masked sample left out: mean of (1, 0, 0) = 1/3 -> [2/3, -1/3, -1/3, 0].
  chex.assert_trees_all_close(obj.group_advantages(rewards, mask=mask), jnp.array([[2 / 3, -1 / 3, -1 / 3, 0.]]),
                              atol=1e-6)
  # A constant group under std scaling: sqrt'(0) = inf must not leak into the gradient as nan.
  grad = jax.grad(lambda r: obj.group_advantages(r, scale_by_std=True).sum())(jnp.ones((2, 4)))
  assert bool(jnp.all(jnp.isfinite(grad)))
  with pytest.raises(ValueError, match=r"rewards must be \[G, K\]"):
    obj.group_advantages(jnp.ones(4))


def test_policy_shaping_values():
  # f(w) = w / (w + .1): f(0) = 0, f(.1) = .5, f(1) = 1/1.1 = .909091, f(9.9) = .99.
  chex.assert_trees_all_close(obj.policy_shaping(jnp.array([0., .1, 1., 9.9])),
                              jnp.array([0., .5, .909091, .99]), atol=1e-6)
  # beta = 1: f(1) = .5, f(3) = .75.
  chex.assert_trees_all_close(obj.policy_shaping(jnp.array([1., 3.]), beta=1.0), jnp.array([.5, .75]), atol=1e-7)


# ----------------------------------------------------------------------------------------------------------------
# token_policy_loss


def _clip_higher_case():
  # Row 0: A = +2, edges 0.8 / 1.28 (clip-higher: clip_low .2, clip_high .28). Row 1: A = -1.
  ratios = [[.5, 1., 1.2, 1.3, 1.5], [.5, .79, .81, 1., 3.]]
  return _lw(ratios), jnp.zeros((2, 5)), jnp.array([2., -1.])


def test_fresh_tokens_symmetric_and_clip_higher_on_both_sides_of_each_edge():
  logp, old, adv = _clip_higher_case()
  loss = obj.token_policy_loss(logp, old, adv, clip_low=.2, clip_high=.28)
  # A = 2: -w*A for w <= 1.28: -1, -2, -2.4; beyond: -(1.28)*2 = -2.56 twice.
  # A = -1: w < .8 clipped to -(.8)*(-1) = .8 (w = .5, .79); else -w*A = w: .81, 1, 3 (no upper clip for A < 0).
  chex.assert_trees_all_close(loss, jnp.array([[-1., -2., -2.4, -2.56, -2.56], [.8, .8, .81, 1., 3.]]), atol=1e-5)
  # Symmetric .2: the A = 2 row clips at 1.2: w = 1.3, 1.5 -> -2.4 (w = 1.2 is on the edge; tested separately).
  sym = obj.token_policy_loss(logp, old, adv)
  chex.assert_trees_all_close(sym[0, 3:], jnp.array([-2.4, -2.4]), atol=1e-5)
  # d loss / d logp = -A*w inside (A = 2: -1, -2, -2.4; A = -1: .81, 1, 3), 0 where clipped.
  grad = jax.grad(lambda lp: obj.token_policy_loss(lp, old, adv, clip_low=.2, clip_high=.28).sum())(logp)
  chex.assert_trees_all_close(grad, jnp.array([[-1., -2., -2.4, 0., 0.], [0., 0., .81, 1., 3.]]), atol=1e-5)


def test_dual_clip_and_no_clip():
  logp, old, adv = _clip_higher_case()
  loss = obj.token_policy_loss(logp, old, adv, clip_low=.2, clip_high=.28, dual_clip=2.0)
  # Only A < 0 and w > c = 2 changes: w = 3 -> min(3, -c*A = 2) = 2; everything else as without dual clip.
  chex.assert_trees_all_close(loss[1], jnp.array([.8, .8, .81, 1., 2.]), atol=1e-5)
  chex.assert_trees_all_close(loss[0], jnp.array([-1., -2., -2.4, -2.56, -2.56]), atol=1e-5)
  grad = jax.grad(lambda lp: obj.token_policy_loss(lp, old, adv, dual_clip=2.0).sum())(logp)
  assert float(grad[1, 4]) == 0.0  # the capped token is a constant 2
  # clip=False: -w*A everywhere (dual clip off too): row 0 = -2w, row 1 = w.
  free = obj.token_policy_loss(logp, old, adv, clip=False, dual_clip=2.0)
  chex.assert_trees_all_close(free, jnp.array([[-1., -2., -2.4, -2.6, -3.], [.5, .79, .81, 1., 3.]]), atol=1e-5)
  # A traced per-row clip flag picks the clipped loss in row 0 and the free one in row 1 in one call.
  mixed = jax.jit(lambda c: obj.token_policy_loss(logp, old, adv, clip=c, dual_clip=2.0))(jnp.array([True, False]))
  chex.assert_trees_all_close(mixed, jnp.stack([obj.token_policy_loss(logp, old, adv, dual_clip=2.0)[0], free[1]]))


def test_replayed_tokens_are_shaped_never_clipped_and_gradient_is_analytic():
  w = jnp.array([[.1, 1., 2., 5.]])
  logp, old = _lw(w), jnp.zeros((1, 4))
  loss = obj.token_policy_loss(logp, old, jnp.array([1.]), replayed=jnp.array([True]))
  # -f(w) * 1 with beta .1: -.1/.2 = -.5, -1/1.1 = -.909091, -2/2.1 = -.952381, -5/5.1 = -.980392 (no clip at 1.2).
  chex.assert_trees_all_close(loss, jnp.array([[-.5, -.909091, -.952381, -.980392]]), atol=1e-5)
  # d/dlogp of -A f(w) = -A beta w / (w + beta)^2: -.01/.04 = -.25, -.1/1.21 = -.0826446, -.2/4.41 = -.0453515,
  # -.5/26.01 = -.0192234.
  grad = jax.grad(lambda lp: obj.token_policy_loss(lp, old, jnp.array([1.]), replayed=jnp.array([True])).sum())(logp)
  chex.assert_trees_all_close(grad, jnp.array([[-.25, -.0826446, -.0453515, -.0192234]]), atol=1e-6)
  # Closed form for A = -3, beta = .5, over a grid of log-ratios, [B, T] replayed flags.
  lr = jnp.linspace(-4., 4., 9)[None]
  grad = jax.grad(lambda x: obj.token_policy_loss(x, jnp.zeros_like(x), jnp.full((1, 9), -3.),
                                                  replayed=jnp.ones((1, 9), bool), shaping_beta=.5).sum())(lr)
  ww = jnp.exp(lr)
  chex.assert_trees_all_close(grad, 3. * .5 * ww / (ww + .5) ** 2, rtol=1e-5)
  # Huge log-ratios stay finite (f(w) is computed as a sigmoid of log w - log beta).
  big = obj.token_policy_loss(jnp.array([[200., -200.]]), jnp.zeros((1, 2)), jnp.array([1.]),
                              replayed=jnp.array([True]))
  chex.assert_trees_all_close(big, jnp.array([[-1., 0.]]), atol=1e-6)


def test_replayed_mixed_with_fresh_and_beta_none_treats_them_as_fresh():
  logp = _lw([[2., 2.], [2., 2.]])
  old = jnp.zeros((2, 2))
  adv = jnp.array([[1., 1.], [1., 1.]])
  loss = obj.token_policy_loss(logp, old, adv, replayed=jnp.array([[True, False], [False, False]]))
  # Replayed (0, 0): -f(2) = -2/2.1 = -.952381; fresh w = 2 > 1.2 with A = 1: clipped to -1.2.
  chex.assert_trees_all_close(loss, jnp.array([[-.952381, -1.2], [-1.2, -1.2]]), atol=1e-5)
  like_fresh = obj.token_policy_loss(logp, old, adv, replayed=jnp.array([True, True]), shaping_beta=None)
  chex.assert_trees_all_close(like_fresh, jnp.full((2, 2), -1.2), atol=1e-5)  # all clipped at 1.2


def test_per_sequence_and_per_token_inputs_agree_and_bad_shapes_name_the_argument():
  logp, old, adv = _clip_higher_case()
  a = obj.token_policy_loss(logp, old, adv, replayed=jnp.array([True, False]))
  b = obj.token_policy_loss(logp, old, jnp.repeat(adv[:, None], 5, 1),
                            replayed=jnp.array([[True] * 5, [False] * 5]))
  chex.assert_trees_all_equal(a, b)
  with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
    obj.token_policy_loss(logp, old, jnp.ones(3))
  with pytest.raises(ValueError, match="dual_clip .*got 0.5"):
    obj.token_policy_loss(logp, old, adv, dual_clip=0.5)


# ----------------------------------------------------------------------------------------------------------------
# The clip boundary: full gradient exactly on each edge, like the PPO/verl torch reference.


def _verl_torch_loss(torch, logp, old, adv, lo, hi, c):
  """verl's compute_policy_loss (vanilla, dual clip), written out in torch: the reference at the edges."""
  ratio = torch.exp(logp - old)
  pg1 = -adv * ratio
  pg2 = -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
  clipped = torch.maximum(pg1, pg2)
  return torch.where(adv < 0, torch.min(-adv * c, clipped), clipped)


def test_jax_clip_gradient_at_its_edges_is_half():
  # The behaviour that motivated the decision: jnp.clip passes 1/2 exactly at an edge, torch.clamp passes 1.
  g = jax.grad(lambda x: jnp.clip(x, .8, 1.2))
  assert (float(g(.8)), float(g(1.2)), float(g(1.)), float(g(1.3))) == (.5, .5, 1., 0.)


def test_gradient_exactly_on_the_clip_edges_matches_torch_reference():
  torch = pytest.importorskip("torch")
  # Ratios exactly 1 - clip_low = .8 (A = -1) and 1 + clip_high = 1.28 (A = +2), plus points either side.
  x_lo, x_hi = _exact_log(.8), _exact_log(1.28)
  logp = np.array([[x_lo, x_lo - .01, x_lo + .01], [x_hi, x_hi - .01, x_hi + .01]], np.float32)
  adv = np.array([[-1.], [2.]], np.float32)
  ours = jax.grad(lambda lp: obj.token_policy_loss(lp, jnp.zeros_like(lp), jnp.asarray(adv)[:, 0], clip_low=.2,
                                                   clip_high=.28, dual_clip=3.).sum())(jnp.asarray(logp))
  lp_t = torch.tensor(logp, requires_grad=True)
  _verl_torch_loss(torch, lp_t, torch.zeros_like(lp_t), torch.tensor(adv), .2, .28, 3.).sum().backward()
  # On the edge: full -A*w (.8 and -2.56); just inside: -A*w; just outside: 0.
  # Row 0: [.8, 0 (w < .8 clipped), .808]; row 1: [-2.56, -2*1.2673, 0 (w > 1.28 clipped)].
  np.testing.assert_allclose(np.asarray(ours), lp_t.grad.numpy(), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(ours)[:, 0], [.8, -2.56], rtol=1e-6)
  assert float(ours[0, 1]) == 0. and float(ours[1, 2]) == 0.
  # A direct JAX port (jnp.minimum + jnp.clip) gets 1/2 + 1/2 * 1/2 = 3/4 of it on the edge: -1.92, not -2.56.
  port = jax.grad(lambda x: -jnp.minimum(jnp.exp(x) * 2., jnp.clip(jnp.exp(x), .8, 1.28) * 2.))(jnp.float32(x_hi))
  np.testing.assert_allclose(float(port), -1.92, rtol=1e-6)


def test_dual_clip_edge_keeps_full_gradient():
  x_c = _exact_log(3.)
  grad = jax.grad(lambda lp: obj.token_policy_loss(lp, jnp.zeros_like(lp), jnp.array([-1.]), dual_clip=3.).sum())(
      jnp.array([[x_c, x_c + 1e-3]], jnp.float32))
  # w == c exactly: inside (-A*w = 3); w just above c: capped, 0. (verl's torch.min tie would give 1.5 on the edge.)
  np.testing.assert_allclose(np.asarray(grad), [[3., 0.]], rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Aggregation


_PER_TOKEN = jnp.array([[1., 2., 3., jnp.nan], [5., 6., 7., 8.], [9., 9., 9., 9.]])
_MASK = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)


@pytest.mark.parametrize("mode, max_len, expected, normalizer", [
    ("token-mean", None, 3.4, 5.),            # (1 + 2 + 3 + 5 + 6) = 17 over 5 tokens
    ("seq-mean-token-mean", None, 3.75, 2.),  # (6/3 + 11/2) / 2 sequences with tokens (row 2 is empty)
    ("seq-mean-token-sum", None, 8.5, 2.),    # (6 + 11) / 2
    ("dr_grpo", 8, 1.0625, 16.),              # 17 / (N = 2 * L = 8)
    ("dr_grpo", None, 2.125, 8.),             # L defaults to the padded width 4: 17 / (2 * 4)
    ("exgrpo_reference", 8, 2.125, 8.),       # 17 / L
])
def test_aggregate_loss_modes(mode, max_len, expected, normalizer):
  # The masked nan in row 0 and the masked 9s in row 2 must not leak in.
  chex.assert_trees_all_close(obj.aggregate_loss(_PER_TOKEN, _MASK, mode=mode, max_len=max_len), expected, atol=1e-6)
  chex.assert_trees_all_close(obj.loss_normalizer(_MASK, mode=mode, max_len=max_len), normalizer)


@pytest.mark.parametrize("mode", obj.AGGREGATION_MODES)
def test_padding_rows_and_columns_change_nothing(mode):
  # Two more padded columns and one more all-padding row: with L fixed, every mode gives the same loss (row 2 of
  # _MASK is already such a row, so N = 2 throughout).
  padded = jnp.pad(jnp.nan_to_num(_PER_TOKEN), ((0, 1), (0, 2)), constant_values=5.)
  mask = jnp.pad(_MASK, ((0, 1), (0, 2)))
  chex.assert_trees_all_close(obj.aggregate_loss(padded, mask, mode=mode, max_len=8),
                              obj.aggregate_loss(_PER_TOKEN, _MASK, mode=mode, max_len=8), atol=1e-7)


def test_aggregate_loss_float_weights_empty_batch_and_errors():
  # Float mask weights: token-mean = (.5*1 + 1*2) / 1.5 = 1.666667.
  chex.assert_trees_all_close(obj.aggregate_loss(jnp.array([[1., 2.]]), jnp.array([[.5, 1.]]), mode="token-mean"),
                              1.666667, atol=1e-6)
  for mode in obj.AGGREGATION_MODES:  # no tokens at all: 0, not nan
    assert float(obj.aggregate_loss(jnp.ones((2, 3)), jnp.zeros((2, 3)), mode=mode)) == 0.
  with pytest.raises(ValueError, match="'mean' is not one of token-mean, seq-mean-token-mean"):
    obj.aggregate_loss(_PER_TOKEN, _MASK, mode="mean")
  with pytest.raises(ValueError, match=r"per_token shape \(3, 4\) != mask shape \(3, 3\)"):
    obj.aggregate_loss(_PER_TOKEN, _MASK[:, :3])


def test_sequence_mean():
  # Row 0: (1 + 2) / 2 = 1.5; row 1 has no tokens: 0.
  chex.assert_trees_all_close(obj.sequence_mean(jnp.array([[1., 2., 3.], [4., 5., 6.]]),
                                                jnp.array([[1, 1, 0], [0, 0, 0]])), jnp.array([1.5, 0.]))


# ----------------------------------------------------------------------------------------------------------------
# KL, truncated importance weights, entropy, group filters


def test_kl_estimators_values_and_gradients():
  logp = jnp.log(jnp.array([[.5, .25]]))
  ref = jnp.log(jnp.array([[.25, .5]]))
  # x = logp - ref = [ln 2, -ln 2].
  chex.assert_trees_all_close(obj.kl_penalty(logp, ref, estimator="k1"), jnp.array([[LN2, -LN2]]), atol=1e-6)
  # k2 = x^2 / 2 = .480453 / 2 = .240227.
  chex.assert_trees_all_close(obj.kl_penalty(logp, ref, estimator="k2"), jnp.array([[.240227, .240227]]), atol=1e-6)
  # k3 = exp(-x) - 1 + x: .5 - 1 + .693147 = .193147; 2 - 1 - .693147 = .306853.
  chex.assert_trees_all_close(obj.kl_penalty(logp, ref), jnp.array([[.193147, .306853]]), atol=1e-6)
  # d k3 / d logp = 1 - exp(-x) = [.5, -1].
  chex.assert_trees_all_close(jax.grad(lambda lp: obj.kl_penalty(lp, ref).sum())(logp), jnp.array([[.5, -1.]]),
                              atol=1e-6)
  with pytest.raises(ValueError, match="'k4' is not one of k1, k2, k3"):
    obj.kl_penalty(logp, ref, estimator="k4")


def test_truncated_importance_weights():
  behaviour = jnp.zeros((1, 4))
  old = jnp.array([[LN2, math.log(5.), -LN2, 100.]])
  # min(exp(old - behaviour), 3): 2, 3 (capped from 5), .5, 3 (exp(100) would overflow: capped in log space).
  chex.assert_trees_all_close(obj.truncated_importance_weights(old, behaviour, cap=3.),
                              jnp.array([[2., 3., .5, 3.]]), atol=1e-6)
  grad = jax.grad(lambda o: obj.truncated_importance_weights(o, behaviour, cap=3.).sum())(old)
  assert float(jnp.abs(grad).sum()) == 0.  # stop-gradient weights
  with pytest.raises(ValueError, match="importance_cap.*got 0"):
    obj.truncated_importance_weights(old, behaviour, cap=0)


def test_entropy_and_logprobs_hand_values_and_chunking():
  # Uniform over V = 4: H = ln 4 = 1.386294, log p = -ln 4. Logits (0, ln 3): p = (.25, .75),
  # H = -(.25 ln .25 + .75 ln .75) = .346574 + .215762 = .562335.
  logits = jnp.array([[[0., 0., 0., 0.], [0., math.log(3.), -1e9, -1e9]]])
  lp, ent = obj.logprobs_and_entropy(logits, jnp.array([[2, 1]]))
  chex.assert_trees_all_close(ent, jnp.array([[1.386294, .562335]]), atol=1e-5)
  chex.assert_trees_all_close(lp, jnp.array([[-1.386294, math.log(.75)]]), atol=1e-5)
  # Temperature 2 halves the logits: (0, ln 3 / 2) -> p = (1, sqrt 3)/(1 + sqrt 3) = (.366025, .633975).
  chex.assert_trees_all_close(obj.token_logprobs(logits, jnp.array([[0, 1]]), temperature=2.)[0, 1],
                              math.log(.633975), atol=1e-5)
  # Chunks of 3 over T = 7 (the last chunk overlaps) equal the one-shot values, and so do their gradients.
  x = jax.random.normal(jax.random.key(0), (2, 7, 11))
  t = jax.random.randint(jax.random.key(1), (2, 7), 0, 11)
  def values_and_grad(chunk):
    fn = lambda z: obj.logprobs_and_entropy(z, t, chunk_size=chunk)
    return jax.jit(lambda z: (fn(z), jax.grad(lambda y: sum(a.sum() for a in fn(y)))(z)))(x)
  chex.assert_trees_all_close(values_and_grad(3), values_and_grad(None), atol=1e-6)
  assert obj.logprobs_and_entropy(x, None, chunk_size=3)[0] is None
  assert obj.token_entropy(x.astype(jnp.bfloat16), chunk_size=3).dtype == jnp.float32


def test_entropy_chunks_bound_the_float32_working_set():
  x = jnp.zeros((2, 64, 512), jnp.float32)
  t = jnp.zeros((2, 64), jnp.int32)
  full_bytes = 2 * 64 * 512 * 4  # one float32 copy of the logits: 262144 bytes

  def temp_bytes(chunk):
    fn = lambda z: sum(a.sum() for a in obj.logprobs_and_entropy(z, t, chunk_size=chunk))
    return (jax.jit(fn).lower(x).compile().memory_analysis().temp_size_in_bytes,
            jax.jit(jax.grad(fn)).lower(x).compile().memory_analysis().temp_size_in_bytes)

  unchunked, chunked = temp_bytes(None), temp_bytes(8)
  assert unchunked[0] >= full_bytes  # the one-shot softmax needs a full f32 temporary
  # 8 of 64 positions per chunk: forward and backward temporaries stay well under one full copy.
  assert chunked[0] < full_bytes / 2 and chunked[1] < full_bytes / 2, (unchunked, chunked)


def test_group_filters():
  rewards = np.array([[1., 1., 1.], [0., 1., 0.], [0., 0., 0.]])
  # Groups 0 and 2 are constant.
  chex.assert_trees_all_equal(obj.constant_group_mask(rewards), jnp.array([True, False, True]))
  per_rollout, per_group = np.arange(9), np.array([10, 20, 30])
  kept_r, kept_rows, kept_groups = obj.drop_constant_groups(rewards, per_rollout, per_group)
  np.testing.assert_array_equal(kept_r, [[0., 1., 0.]])
  np.testing.assert_array_equal(kept_rows, [3, 4, 5])  # group 1's three rollouts, group-major
  np.testing.assert_array_equal(kept_groups, [20])
  with pytest.raises(ValueError, match="row 0 has leading size 4; expected G=3 or G\\*K=9"):
    obj.drop_constant_groups(rewards, np.arange(4))
  # Near-constant within atol counts as constant.
  assert bool(obj.constant_group_mask(jnp.array([[1., 1.05]]), atol=.1)[0])


# ----------------------------------------------------------------------------------------------------------------
# jit: traced once per shape; vmap and grad safe


def _new_values(a):
  """Same shape and dtype, other values: a second call must hit the jit cache."""
  return ~a if a.dtype == bool else (a * 0.5 + 1).astype(a.dtype)


def test_every_function_traces_once_per_shape():
  logp, old, adv = _clip_higher_case()
  mask = jnp.ones((2, 5), bool)
  replayed = jnp.array([True, False])
  logits = jnp.zeros((2, 5, 7))
  cases = [
      (lambda r: obj.group_advantages(r, scale_by_std=True), (jnp.ones((3, 4)),)),
      (lambda w: obj.policy_shaping(w), (jnp.ones(5),)),
      (lambda a, b, c, d: obj.token_policy_loss(a, b, c, replayed=d, dual_clip=3.), (logp, old, adv, replayed)),
      (lambda a, m: obj.aggregate_loss(a, m, mode="seq-mean-token-mean"), (logp, mask)),
      (lambda m: obj.loss_normalizer(m, mode="dr_grpo", max_len=8), (mask,)),
      (lambda a, b: obj.kl_penalty(a, b), (logp, old)),
      (lambda a, b: obj.truncated_importance_weights(a, b, cap=3.), (logp, old)),
      (lambda z, t: obj.logprobs_and_entropy(z, t, chunk_size=2), (logits, jnp.zeros((2, 5), jnp.int32))),
      (lambda a, m: obj.sequence_mean(a, m), (logp, mask)),
      (lambda r: obj.constant_group_mask(r), (jnp.ones((3, 4)),)),
  ]
  for fn, args in cases:
    jitted = jax.jit(chex.assert_max_traces(fn, n=1))
    first = jitted(*args)
    second = jitted(*jax.tree.map(_new_values, args))
    jax.tree.map(lambda a, b: chex.assert_equal_shape([a, b]), first, second)
    with pytest.raises(AssertionError, match="traced > 1 times"):  # a new shape is a new trace, and the counter sees it
      jitted(*jax.tree.map(lambda a: jnp.concatenate([a, a]), args))


def test_vmap_matches_a_loop():
  logp, old, adv = _clip_higher_case()
  stack = lambda x: jnp.stack([x, 2. * x])  # [2, ...]
  vm = jax.vmap(lambda a, b, c: obj.aggregate_loss(
      obj.token_policy_loss(a, b, c, replayed=jnp.array([True, False])), jnp.ones((2, 5)), mode="token-mean"))
  out = vm(stack(logp), stack(old), stack(adv))
  for i in range(2):
    ref = obj.aggregate_loss(obj.token_policy_loss(stack(logp)[i], stack(old)[i], stack(adv)[i],
                                                   replayed=jnp.array([True, False])), jnp.ones((2, 5)),
                             mode="token-mean")
    chex.assert_trees_all_close(out[i], ref, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Settings from the config


def test_loss_settings_from_config():
  config = importlib.import_module("configs.grpo").get_config(None)
  settings = obj.LossSettings.from_config(config)
  # base: dual_clip 0 -> None, importance_cap 0 -> None, max_len 0 -> rollout.max_new_tokens.
  assert settings.dual_clip is None and settings.importance_cap is None
  assert settings.max_len == config.rollout.max_new_tokens and settings.aggregation == "dr_grpo"
  assert settings.aggregate_kwargs() == {"mode": "dr_grpo", "max_len": config.rollout.max_new_tokens}
  # ExGRPO's mixed phase drops the clip of fresh tokens unless mixed_clip; a traced switch gives a traced flag.
  assert settings.policy_loss_kwargs(mixed_phase=False)["clip"] is True
  assert settings.policy_loss_kwargs(mixed_phase=True)["clip"] is False
  traced = jax.jit(lambda p: settings.policy_loss_kwargs(mixed_phase=p)["clip"])(jnp.array(True))
  assert not bool(traced)
  with config.unlocked():
    config.loss.shaping_beta = 0.5
    config.loss.dual_clip = 10.
  assert obj.LossSettings.from_config(config).shaping_beta == 0.5
  assert obj.LossSettings.from_config(config).dual_clip == 10.
  with pytest.raises(ValueError, match="loss.kl_estimator='k9'"):
    obj.LossSettings(kl_estimator="k9")


# ----------------------------------------------------------------------------------------------------------------
# Micro-batch and data-parallel invariance: a linear "policy" logits = x @ W, every mode at once.

_N, _T, _D, _V, _L = 8, 6, 4, 5, 8


def _policy_batch():
  k = jax.random.split(jax.random.key(7), 4)
  w_old = .5 * jax.random.normal(k[0], (_D, _V))
  params = w_old + .3 * jax.random.normal(k[1], (_D, _V))  # ratios land on both sides of the clip edges
  feats = jax.random.normal(k[2], (_N, _T, _D))
  tokens = jax.random.randint(k[3], (_N, _T), 0, _V)
  old_logp = obj.token_logprobs(feats @ w_old, tokens)
  lengths = jnp.array([6, 1, 3, 0, 5, 2, 6, 4])  # unequal per micro-batch, one empty row
  batch = dict(feats=feats, tokens=tokens, old_logp=old_logp, ref_logp=old_logp - .1,
               adv=jnp.array([1., -1., .5, 0., -.5, 2., -2., .25]),
               replayed=jnp.array([False, True, False, False, True, False, False, True]),
               mask=jnp.arange(_T)[None] < lengths[:, None])
  return params, batch


def _mode_losses(params, b, normalizers=None):
  """[5] losses, one per aggregation mode, of PPO / shaped terms + KL - entropy bonus."""
  logits = b["feats"] @ params  # [n, T, V]
  logp, entropy = obj.logprobs_and_entropy(logits, b["tokens"])
  per_token = obj.token_policy_loss(logp, b["old_logp"], b["adv"], replayed=b["replayed"], clip_low=.2,
                                    clip_high=.28, dual_clip=2.)
  per_token = per_token + .1 * obj.kl_penalty(logp, b["ref_logp"]) - .01 * entropy
  return jnp.stack([obj.aggregate_loss(per_token, b["mask"], mode=mode, max_len=_L,
                                       normalizer=None if normalizers is None else normalizers[i])
                    for i, mode in enumerate(obj.AGGREGATION_MODES)])


def _global_normalizers(mask):
  return jnp.stack([obj.loss_normalizer(mask, mode=mode, max_len=_L) for mode in obj.AGGREGATION_MODES])


def _microbatch_grads(params, batch, num_micro, *, use_global=True):
  """Sum of per-micro-batch gradients [5, D, V] under lax.scan, as the update step accumulates them."""
  normalizers = _global_normalizers(batch["mask"]) if use_global else None
  split = jax.tree.map(lambda x: x.reshape(num_micro, _N // num_micro, *x.shape[1:]), batch)  # [M, n, ...]

  def accumulate(total, micro):
    return total + jax.jacrev(_mode_losses)(params, micro, normalizers), None

  return jax.lax.scan(accumulate, jnp.zeros((5, _D, _V)), split)[0]


def _relative_errors(grads, reference):
  return [float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) for g, r in zip(grads, reference)]


def test_gradient_is_invariant_to_microbatching_for_every_mode():
  params, batch = _policy_batch()
  reference = jax.jit(jax.jacrev(_mode_losses))(params, batch)  # [5, D, V], the single-batch gradient
  assert all(float(jnp.linalg.norm(r)) > 1e-3 for r in reference)
  for num_micro in (1, 2, 4):
    grads = jax.jit(_microbatch_grads, static_argnums=2)(params, batch, num_micro)
    assert max(_relative_errors(grads, reference)) <= 1e-6, (num_micro, _relative_errors(grads, reference))
  # The bug class this prevents: each micro-batch normalised by its own tokens / sequences. Only exgrpo_reference
  # (a constant L) survives that; the other four modes change by far more than the tolerance.
  naive = _relative_errors(jax.jit(lambda p, b: _microbatch_grads(p, b, 2, use_global=False))(params, batch),
                           reference)
  assert min(naive[:4]) > 1e-2 and naive[4] <= 1e-6, naive


def test_gradient_is_invariant_on_an_8_device_mesh_for_every_mode():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == 8
  params, batch = _policy_batch()
  reference = jax.jit(jax.jacrev(_mode_losses))(params, batch)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))  # one row per device
  # GSPMD: the global-batch loss, jitted with the batch sharded.
  grads = jax.jit(jax.jacrev(_mode_losses), out_shardings=NamedSharding(mesh, P()))(params, sharded)
  assert max(_relative_errors(grads, reference)) <= 1e-6, _relative_errors(grads, reference)

  # Explicit data parallelism: each device takes the gradient of its own rows with the global normalisers, then psum.
  # (check_vma=False keeps the local gradient local; with it on, jax would already psum the replicated params' grads.)
  def per_device(p, local, normalizers):
    return jax.lax.psum(jax.jacrev(_mode_losses)(p, local, normalizers), "data")

  dp = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=P(), check_vma=False))
  grads = dp(params, sharded, _global_normalizers(batch["mask"]))
  assert max(_relative_errors(grads, reference)) <= 1e-6, _relative_errors(grads, reference)
