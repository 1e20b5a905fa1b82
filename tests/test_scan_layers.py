"""model.scan_layers: the layers as one lax.scan over their stacked weights give the unrolled loop's hidden states,
logits, loss and gradients (padded and packed rows, with and without remat, on one device and on a mesh), in a
program that holds one layer's body in a loop; the cached (sampler) path keeps the unrolled loop."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import parallel
from jaxrlvr.models import PRESETS, Transformer

_TINY = PRESETS["tiny"]  # 4 layers, GQA, q/k/v bias, tied embeddings
_VOCAB = _TINY.vocab_size


def _pair(config, seed=0):
  """The same weights (same seed) built unrolled and scanned."""
  return (Transformer(config, rngs=nnx.Rngs(seed)),
          Transformer(config.replace(scan_layers=True), rngs=nnx.Rngs(seed)))


def _ids(shape, seed=1):
  return jax.random.randint(jax.random.key(seed), shape, 1, _VOCAB)


def _padded_batch():
  """ids [2, 8] and a mask whose second row is left-padded by three slots, as the sampler lays out prompts."""
  return _ids((2, 8)), jnp.array([[1] * 8, [0, 0, 0] + [1] * 5])


def _packed_batch():
  """ids [2, 8] with two sequences packed into row 0 (3 + 4 tokens, then padding) and one in row 1, each sequence's
  positions from 0, as the update packs completions."""
  segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 0, 0]])
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 0, 0]])
  return _ids((2, 8), seed=2), segment_ids, positions


def _loss_and_hidden(model, rows):
  """A loss over the logits of padded or packed rows, and the pass's hidden states as its aux."""
  if rows == "padded":
    ids, mask = _padded_batch()
    hidden, _ = model.hidden(ids, attention_mask=mask)
    logp = jax.nn.log_softmax(model.logits(hidden[:, :-1]))
    return -(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0] * mask[:, 1:]).mean(), hidden
  ids, segment_ids, positions = _packed_batch()
  hidden, _ = model.hidden(ids, segment_ids=segment_ids, positions=positions)
  return (model.logits(hidden)[..., 3] * (segment_ids > 0)).mean(), hidden


# Padded rows without remat, packed rows with it: each case compiles 2 update programs (a few seconds on 2 cores).
@pytest.mark.parametrize("rows, remat", [("padded", False), ("packed", True)], ids=["padded", "packed-remat"])
def test_scanned_hidden_states_loss_and_gradients_equal_unrolled(rows, remat):
  """float32: the same hidden states, loss and gradients, tightly. jax.grad through the scan (and its
  jax.checkpoint) gives each layer its own gradient, as the unrolled loop does; the untied head keeps every leaf's
  gradient distinct."""
  plain, scanned = _pair(_TINY.replace(remat=remat, tie_embeddings=False))
  grad_fn = nnx.jit(nnx.value_and_grad(lambda m: _loss_and_hidden(m, rows), has_aux=True))
  (loss_a, hidden_a), grads_a = grad_fn(plain)
  (loss_b, hidden_b), grads_b = grad_fn(scanned)
  real = np.asarray(_padded_batch()[1] if rows == "padded" else _packed_batch()[1], bool)  # padding is never read
  np.testing.assert_allclose(np.asarray(hidden_b)[real], np.asarray(hidden_a)[real], atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
  leaves_a, leaves_b = jax.tree.leaves_with_path(grads_a), jax.tree.leaves_with_path(grads_b)
  assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]  # one gradient per layer's leaf, as the params are
  for (path, a), (_, b) in zip(leaves_a, leaves_b):
    assert a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-5, err_msg=jax.tree_util.keystr(path))
  # The layers' gradients differ from one another: the scan did not hand every layer the same slice.
  first, last = grads_b["layers"][0]["mlp"]["up_proj"][...], grads_b["layers"][3]["mlp"]["up_proj"][...]
  assert np.abs(np.asarray(first)).max() > 0 and not np.allclose(np.asarray(first), np.asarray(last))


def _compiled_forward(model, ids, mask):
  """(logits, the number of dot ops and of while loops in the optimised program) of a jitted forward."""
  graphdef, state = nnx.split(model)
  compiled = jax.jit(lambda s, x, m: nnx.merge(graphdef, s)(x, attention_mask=m)).lower(state, ids, mask).compile()
  text = compiled.as_text()
  return compiled(state, ids, mask), len(re.findall(r"= \S+ dot\(", text)), text.count(" while(")


def test_scanned_program_holds_one_layer_in_a_loop_bfloat16():
  """The point of the option: the compiled forward holds one layer's matmuls in a while loop, where the unrolled one
  holds every layer's. In bfloat16 compute (float32 parameters, as the paper-scale configs run) the logits agree
  within bfloat16's rounding: the same casts happen both ways, and XLA's fusion choices are all that may differ."""
  plain, scanned = _pair(_TINY.replace(compute_dtype="bfloat16"))
  ids, mask = _padded_batch()
  logits_a, plain_dots, plain_whiles = _compiled_forward(plain, ids, mask)
  logits_b, scanned_dots, scanned_whiles = _compiled_forward(scanned, ids, mask)
  assert plain_whiles == 0 and scanned_whiles == 1
  # Every layer has the same matmuls (q, k, v, o, gate, up, down and the attention's); both programs add the head's.
  per_layer = (plain_dots - scanned_dots) // (_TINY.num_layers - 1)
  assert per_layer >= 7 and plain_dots == scanned_dots + per_layer * (_TINY.num_layers - 1), (plain_dots, scanned_dots)
  real = np.asarray(mask, bool)
  np.testing.assert_allclose(np.asarray(logits_b)[real], np.asarray(logits_a)[real], atol=5e-2, rtol=5e-2)


def test_cached_pass_keeps_the_unrolled_loop():
  """With a KV cache (the sampler) scan_layers changes nothing: one cache entry a layer, the unrolled program."""
  plain, scanned = _pair(_TINY)
  ids = _ids((2, 5))
  step = nnx.jit(lambda m, tok, c: m.hidden(tok, cache=c, cache_index=jnp.int32(0)))
  a, cache_a = step(plain, ids, plain.init_cache(2, 8))
  b, cache_b = step(scanned, ids, scanned.init_cache(2, 8))
  assert len(cache_b) == _TINY.num_layers
  np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
  np.testing.assert_array_equal(np.asarray(cache_b[3]["k"]), np.asarray(cache_a[3]["k"]))


def test_scanned_forward_on_a_mesh_equals_unrolled():
  """On a 1 x 4 x 2 mesh (weights split over fsdp and tensor, rows over fsdp, the carry held to the rows' sharding)
  the scanned forward equals the unrolled one."""
  mesh = parallel.make_mesh(1, 4, 2)
  plain = parallel.create_model(_TINY, mesh, seed=0)
  scanned = parallel.create_model(_TINY.replace(scan_layers=True), mesh, seed=0)
  ids = parallel.shard_batch(_ids((8, 8)), mesh)
  forward = nnx.jit(lambda m, x: m(x))
  expected, got = forward(plain, ids), forward(scanned, ids)
  assert got.sharding.is_equivalent_to(expected.sharding, expected.ndim)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=1e-5)
