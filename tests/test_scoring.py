"""Teacher-forced scoring: equals full-logit log-softmax, chunked memory, gradients, inside jit, sharded."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import scoring
from jaxrlvr.models import ModelConfig, Transformer

_CONFIG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, initializer_range=0.3)


@pytest.fixture(scope="module")
def model():
  return Transformer(_CONFIG, rngs=nnx.Rngs(1))


def _batch():
  """Left-padded prompts, then answers, then right padding: ids [3, 11], mask [3, 11]."""
  rows = [(3, 5), (1, 8), (6, 2)]  # (left padding, real tokens)
  ids = np.zeros((3, 11), np.int32)
  mask = np.zeros((3, 11), np.int32)
  rs = np.random.RandomState(0)
  for r, (left, n) in enumerate(rows):
    ids[r, left:left + n] = rs.randint(1, 64, size=n)
    mask[r, left:left + n] = 1
  return jnp.asarray(ids), jnp.asarray(mask)


def _reference(model, ids, mask, temperature=1.0):
  """Full [B, T, V] logits, log-softmax, shift: the definition `score` must match."""
  logits = model(ids, attention_mask=mask) / temperature  # [B, T, V]
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)[:, :-1]
  pad = jnp.zeros((ids.shape[0], 1))
  keep = mask.astype(bool)
  return (jnp.where(keep, jnp.concatenate([pad, logp], 1), 0.0), jnp.where(keep, jnp.concatenate([pad, ent], 1), 0.0))


@pytest.mark.parametrize("chunk_size,vocab_chunk_size,temperature", [(128, 32768, 1.0), (4, 24, 1.0), (3, 64, 0.6)])
def test_score_equals_full_logits(model, chunk_size, vocab_chunk_size, temperature):
  ids, mask = _batch()
  logp, ent = scoring.score_jit(model, ids, mask, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
                                temperature=temperature)
  ref_logp, ref_ent = _reference(model, ids, mask, temperature)
  assert logp.shape == ent.shape == (3, 11)
  np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=0)
  np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=0)
  # Position 0 and padding get 0; the first real token of each row has no prediction from padding either way.
  assert np.all(np.asarray(logp)[np.asarray(mask) == 0] == 0)


@pytest.mark.parametrize("last", [1, 6, 10, 11])
def test_score_of_the_last_positions_is_the_full_scores_tail(model, last):
  """`last` runs the head on the last positions alone (an update's completions); the numbers are the full
  scoring's, position 0 included when `last` covers it."""
  ids, mask = _batch()
  logp, ent = jax.jit(lambda m, i, k: scoring.score(m, i, k, chunk_size=4, last=last))(model, ids, mask)
  ref_logp, ref_ent = _reference(model, ids, mask)
  assert logp.shape == ent.shape == (3, last)
  np.testing.assert_allclose(logp, ref_logp[:, -last:], atol=1e-5, rtol=0)
  np.testing.assert_allclose(ent, ref_ent[:, -last:], atol=1e-5, rtol=0)


def test_vocab_chunks():
  assert scoring._vocab_chunks(64, 24) == (4, 16)  # 3 chunks of ~24 do not divide 64; 4 of 16 do
  assert scoring._vocab_chunks(151936, 32768) == (8, 18992)  # Qwen2.5: 151936 = 8 * 18992
  assert scoring._vocab_chunks(67, 16) == (5, 16)  # 67 is prime: 5 chunks of 16, the last overlapping at 51
  assert scoring._vocab_chunks(64, 100) == (1, 64)


def test_chunked_logprobs_overlapping_vocab_and_memory():
  """A prime vocabulary (overlapping last chunk) is exact, and no intermediate, forward or backward, is larger than
  one [B, C, Vc] logits block: 2 * 16 * 16 = 512 floats, against 2 * 64 * 67 = 8576 for full logits."""
  rs = np.random.RandomState(0)
  b, t, d, v = 2, 64, 8, 67
  hidden = jnp.asarray(rs.randn(b, t, d), jnp.float32)
  w = jnp.asarray(rs.randn(d, v), jnp.float32)
  targets = jnp.asarray(rs.randint(0, v, size=(b, t)), jnp.int32)
  fn = lambda h, w: scoring.chunked_logprobs(h, w, targets, chunk_size=16, vocab_chunk_size=16)
  logp, ent = fn(hidden, w)
  full = jax.nn.log_softmax(hidden @ w, axis=-1)
  np.testing.assert_allclose(logp, jnp.take_along_axis(full, targets[..., None], -1)[..., 0], atol=1e-5)
  np.testing.assert_allclose(ent, -jnp.sum(jnp.exp(full) * full, -1), atol=1e-5)

  loss = lambda h, w: jnp.sum(fn(h, w)[0]) + jnp.sum(fn(h, w)[1])
  # The written-out backward pass, overlap columns and temperature included, against autodiff of full logits.
  hot = lambda h, w: scoring.chunked_logprobs(h, w, targets, chunk_size=16, vocab_chunk_size=16, temperature=0.6)
  hot_loss = lambda h, w: jnp.sum(hot(h, w)[0]) + 0.3 * jnp.sum(hot(h, w)[1])

  def full_loss(h, w):
    logp_all = jax.nn.log_softmax(h @ w / 0.6, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    return jnp.sum(logp) - 0.3 * jnp.sum(jnp.exp(logp_all) * logp_all)

  for got, want in zip(jax.grad(hot_loss, argnums=(0, 1))(hidden, w), jax.grad(full_loss, argnums=(0, 1))(hidden, w)):
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hidden, w)
  largest = max(_sizes(jaxpr.jaxpr))
  assert largest <= max(b * 16 * 16, b * t * d, d * v), largest  # [B, C, Vc] vs inputs [B, T, D] = 1024, [D, V] = 536
  assert largest < b * t * v


def test_kept_logits_give_the_chunked_values_and_gradients():
  """`keep_logits=True` (the update's head where its logits fit `train.keep_logits_mb`): one [B, T, V] product kept
  for the backward pass, with the chunked head's log-probs, entropies and gradients, temperature included, and
  the kept logits as the backward pass's only vocabulary-wide product (two products in the backward, not three)."""
  rs = np.random.RandomState(1)
  b, t, d, v = 2, 12, 8, 67
  hidden = jnp.asarray(rs.randn(b, t, d), jnp.float32)
  w = jnp.asarray(rs.randn(d, v), jnp.float32)
  targets = jnp.asarray(rs.randint(0, v, size=(b, t)), jnp.int32)

  def loss(h, w, keep):
    logp, ent = scoring.chunked_logprobs(h, w, targets, chunk_size=4, vocab_chunk_size=16, temperature=0.6,
                                         keep_logits=keep)
    return jnp.sum(logp) + 0.3 * jnp.sum(ent), (logp, ent)

  (_, kept), kept_grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, w, True)
  (_, chunked), chunked_grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, w, False)
  for got, want in zip(kept + kept_grads, chunked + chunked_grads):  # up to float32 rounding of the two orders
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  assert float(jnp.max(jnp.abs(kept_grads[1]))) > 1e-2  # a real gradient reaches the unembedding
  # Vocabulary-wide dots (an output or operand with v columns): the forward's logits and the backward's two.
  jaxpr = jax.make_jaxpr(jax.grad(lambda h, w: loss(h, w, True)[0], argnums=(0, 1)))(hidden, w)
  dots = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) == 3, [e.outvars[0].aval.shape for e in dots]

  assert scoring.logits_kept(16, 64, 49_152, 256.0)  # the smollm2-135m preset's micro-batch: 201 MB
  assert not scoring.logits_kept(4, 8192, 152_064, 256.0)  # Qwen2.5-Math-7B at the paper's lengths: 19 GB
  assert not scoring.logits_kept(1, 1, 2, 0.0)  # 0: always recompute


def _equations(jaxpr):
  """Every equation of a jaxpr and of its sub-jaxprs (scan, checkpoint, custom_vjp, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (list, tuple)) else [param]):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _equations(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _equations(sub)


def _sizes(jaxpr):
  """Element counts of every value a jaxpr (and its sub-jaxprs: scan, checkpoint, ...) produces."""
  for eqn in _equations(jaxpr):
    for var in eqn.outvars:
      yield int(np.prod(var.aval.shape)) if hasattr(var.aval, "shape") else 0


def test_score_gradient_inside_jit(model):
  """Differentiable w.r.t. the params from inside the caller's jit, with the gradient of the full-logit version."""
  ids, mask = _batch()
  graphdef, params = nnx.split(model)

  def loss(params, fn):
    logp, ent = fn(nnx.merge(graphdef, params))
    return jnp.sum(logp) / 10 + 0.01 * jnp.sum(ent)

  chunked = jax.jit(jax.grad(lambda p: loss(p, lambda m: scoring.score(m, ids, mask, chunk_size=4,
                                                                       vocab_chunk_size=16))))(params)
  reference = jax.jit(jax.grad(lambda p: loss(p, lambda m: _reference(m, ids, mask))))(params)
  flat_a, flat_b = jax.tree.leaves(chunked), jax.tree.leaves(reference)
  assert len(flat_a) == len(flat_b) > 0
  for a, b in zip(flat_a, flat_b):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
  assert max(float(jnp.max(jnp.abs(a))) for a in flat_a) > 1e-3  # a real, non-zero gradient


def test_sharded_score_equals_single_device(model):
  from jaxrlvr import parallel

  mesh = parallel.make_mesh(data=1, fsdp=2, tensor=4)  # vocab 64 and MLP over tensor 4; kv heads 2 replicated
  graphdef, state = nnx.split(model)
  sharded = nnx.merge(graphdef, jax.device_put(state, parallel.param_shardings(state, mesh)))
  ids, mask = _batch()
  ids, mask = jnp.concatenate([ids, ids[:1]]), jnp.concatenate([mask, mask[:1]])  # 4 rows over fsdp = 2
  expected = scoring.score_jit(model, ids, mask, chunk_size=4)
  got = scoring.score_jit(sharded, *parallel.shard_batch((ids, mask), mesh), chunk_size=4)
  np.testing.assert_allclose(got[0], expected[0], atol=1e-5)
  np.testing.assert_allclose(got[1], expected[1], atol=1e-5)
  assert got[0].sharding.spec[0] in ("fsdp", ("data", "fsdp"), ("fsdp",))


def test_score_rejects_bad_arguments(model):
  ids, mask = _batch()
  with pytest.raises(ValueError, match="temperature"):
    scoring.score(model, ids, mask, temperature=0.0)
  with pytest.raises(ValueError, match="same"):
    scoring.score(model, ids, mask[:, :-1])
  with pytest.raises(ValueError, match="last=12"):
    scoring.score(model, ids, mask, last=12)


def _grouped_batch(group_size: int, prompt_len: int = 6, completion_len: int = 5):
  """Three groups of `group_size` rows: each group one left-padded prompt, each row its own right-padded answer;
  the last group is filler rows as the batch pads with them (pad ids, one visible prompt token)."""
  rs = np.random.RandomState(1)
  rows = 3 * group_size
  ids = np.zeros((rows, prompt_len + completion_len), np.int32)
  mask = np.zeros_like(ids)
  for g, prompt_tokens in enumerate((4, 6)):
    prompt = rs.randint(1, 64, size=prompt_tokens)
    for r in range(g * group_size, (g + 1) * group_size):
      answer = rs.randint(1, 64, size=rs.randint(1, completion_len + 1))
      ids[r, prompt_len - prompt_tokens:prompt_len] = prompt
      ids[r, prompt_len:prompt_len + len(answer)] = answer
      mask[r, prompt_len - prompt_tokens:prompt_len + len(answer)] = 1
  mask[2 * group_size:, prompt_len - 1] = 1
  return jnp.asarray(ids), jnp.asarray(mask)


@pytest.mark.parametrize("group_size,execution", [(1, {}), (4, {}),
                                                   (4, {"remat": True, "attention": "blockwise",
                                                        "attention_block_size": 4})])
def test_shared_prompts_score_and_differentiate_like_every_row_scored_alone(model, group_size, execution):
  """A group's prompt runs once and its keys serve every sample; log-probs, entropies and the parameter gradient of
  a loss over both equal `score`'s on the completions (float32 rounding apart), with remat and the blockwise
  attention too (the paper-scale settings)."""
  if execution:
    model = Transformer(dataclasses.replace(_CONFIG, **execution), rngs=nnx.Rngs(1))
  ids, mask = _grouped_batch(group_size)
  completion_len = 5
  graphdef, params = nnx.split(model)
  weights = jax.random.normal(jax.random.key(0), (ids.shape[0], completion_len))

  def loss(p, shared):
    m = nnx.merge(graphdef, p)
    if shared:
      logp, ent = scoring.score_shared_prompts(m, ids, mask, group_size=group_size, prompt_len=6, chunk_size=3,
                                               vocab_chunk_size=24)
    else:
      logp, ent = scoring.score(m, ids, mask, chunk_size=3, vocab_chunk_size=24, last=completion_len)
    return jnp.sum(weights * logp) + 0.1 * jnp.sum(ent), (logp, ent)

  (_, (logp, ent)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, True)
  (_, (ref_logp, ref_ent)), ref_grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, False)
  assert logp.shape == (ids.shape[0], completion_len)
  np.testing.assert_allclose(logp, ref_logp, atol=2e-5, rtol=0)
  np.testing.assert_allclose(ent, ref_ent, atol=2e-5, rtol=0)
  assert np.any(np.asarray(ref_logp) != 0)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
