"""models/attention.py: blockwise attention equals the xla path (values and gradients) under every mask the model
builds, its backward pass stays linear in T, "auto" picks as documented, and the model runs on either path."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlvr.models import ModelConfig, Transformer
from jaxrlvr.models import attention as attention_lib


def _inputs(b, t, s, n, kv, h=8, dtype=jnp.float32, seed=0):
  """q [B, T, N, H], k/v [B, K, S, H] and an output cotangent [B, T, N, H]."""
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, h)).astype(dtype)
  k = jax.random.normal(keys[1], (b, kv, s, h)).astype(dtype)
  v = jax.random.normal(keys[2], (b, kv, s, h)).astype(dtype)
  return q, k, v, jax.random.normal(keys[3], (b, t, n, h)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("implementation", "block_size"))
def _value_and_grads(q, k, v, cotangent, query_slots, key_mask, *, implementation, block_size):
  def loss(q, k, v):
    out = attention_lib.attend(q, k, v, query_slots, key_mask, implementation=implementation, block_size=block_size)
    return jnp.sum((out * cotangent).astype(jnp.float32)), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


def _left_padded(b, s, pads):
  return jnp.array([[0] * p + [1] * (s - p) for p in pads[:b]], bool)  # [B, S]


# (batch, T, S, N, K, query_slots, key_mask, block_size): each row a mask the model builds.
_CASES = {
    # Training / scoring: T = S, causal, S = 11 not a multiple of the block, T padded to whole query blocks.
    "causal": (2, 11, 11, 4, 2, jnp.arange(11), jnp.ones((2, 11), bool), 4),
    # Left padding: 3 pads; 9 pads (the first 9 queries see no real key); a row with no real key at all.
    "left_padding": (3, 11, 11, 4, 2, jnp.arange(11), jnp.array([[0] * 3 + [1] * 8, [0] * 9 + [1] * 2, [0] * 11],
                                                               bool), 4),
    # Prefill of P = 6 prompt slots (row 1 left-padded by 4) into an S = P + 5 slot cache at cache_index 0.
    "cache_prefill": (2, 6, 11, 4, 2, jnp.arange(6), _left_padded(2, 11, [0, 4]), 4),
    # A prefill chunk of 4 tokens at cache_index 3 (chunked prefill) and a decode step at slot 8.
    "cache_chunk": (2, 4, 11, 4, 2, 3 + jnp.arange(4), _left_padded(2, 11, [0, 5]), 4),
    "cache_decode": (2, 1, 11, 4, 2, jnp.array([8]), _left_padded(2, 11, [0, 4]), 4),
    # GQA: 4 query heads on one kv head; and 4 on 4 (no grouping).
    "gqa_k1": (2, 9, 9, 4, 1, jnp.arange(9), _left_padded(2, 9, [0, 2]), 4),
    "mha": (1, 9, 9, 4, 4, jnp.arange(9), jnp.ones((1, 9), bool), 4),
    # One block holds everything (block_size > S), and blocks of a single slot.
    "one_block": (2, 7, 7, 4, 2, jnp.arange(7), _left_padded(2, 7, [0, 3]), 512),
    "block_1": (2, 5, 5, 4, 2, jnp.arange(5), _left_padded(2, 5, [0, 2]), 1),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_blockwise_equals_xla_values_and_gradients(case):
  b, t, s, n, kv, query_slots, key_mask, block_size = _CASES[case]
  q, k, v, cotangent = _inputs(b, t, s, n, kv)
  args = (q, k, v, cotangent, jnp.asarray(query_slots, jnp.int32), key_mask)
  expected, expected_grads = _value_and_grads(*args, implementation="xla", block_size=block_size)
  got, got_grads = _value_and_grads(*args, implementation="blockwise", block_size=block_size)
  assert got.shape == (b, t, n, 8) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=1e-5)
  for name, a, e in zip(("dq", "dk", "dv"), got_grads, expected_grads):
    assert a.shape == e.shape, name
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=1e-5, rtol=1e-5, err_msg=name)
  # The cases must exercise gradients: every input gets a non-zero one.
  assert all(float(jnp.abs(g).max()) > 1e-2 for g in got_grads)


def test_blockwise_bfloat16_stays_close_to_float32():
  """bfloat16 inputs: output and gradients in bfloat16, within bfloat16 rounding of the float32 result (as close as
  the xla path in bfloat16 gets)."""
  b, t, s, n, kv, query_slots, key_mask, block_size = _CASES["left_padding"]
  q, k, v, cotangent = _inputs(b, t, s, n, kv)
  args32 = (q, k, v, cotangent, query_slots, key_mask)
  args16 = tuple(x.astype(jnp.bfloat16) for x in (q, k, v, cotangent)) + (query_slots, key_mask)
  exact, exact_grads = _value_and_grads(*args32, implementation="xla", block_size=block_size)
  for implementation in ("blockwise", "xla"):
    out, grads = _value_and_grads(*args16, implementation=implementation, block_size=block_size)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(exact), atol=3e-2, err_msg=implementation)
    for name, a, e in zip(("dq", "dk", "dv"), grads, exact_grads):
      scale = float(jnp.abs(e).max())
      np.testing.assert_allclose(np.asarray(a, np.float32) / scale, np.asarray(e) / scale, atol=3e-2,
                                 err_msg=f"{implementation} {name}")


def _temp_bytes(implementation: str, length: int) -> int:
  """Temporary bytes XLA:CPU allocates for value-and-gradient of one head's attention at T = S = length."""
  q = jax.ShapeDtypeStruct((1, length, 1, 64), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 1, length, 64), jnp.float32)

  def loss(q, k, v):
    out = attention_lib.attend(q, k, v, jnp.arange(length), jnp.ones((1, length), bool),
                               implementation=implementation, block_size=512)
    return jnp.sum(out)

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_backward_does_not_materialise_the_scores():
  """At T = S = 4096 one head's float32 scores are 64 MiB: the xla path's gradient holds more than that, blockwise's
  (512 x 512 blocks, 1 MiB each) stays under 1/8 of it."""
  scores = 4096 * 4096 * 4
  assert _temp_bytes("xla", 4096) > scores
  assert _temp_bytes("blockwise", 4096) < scores / 8


def test_auto_resolves_by_backend_dtype_and_size():
  resolve = attention_lib.resolve
  limit = attention_lib.XLA_MAX_SCORES
  # Plain XLA while the score matrix is small (the embedded default, decode steps), on every backend.
  assert resolve("auto", q_len=42, kv_len=42, dtype=jnp.float32, backend="cpu") == "xla"
  assert resolve("auto", q_len=1, kv_len=limit, dtype=jnp.float32, backend="cpu") == "xla"
  assert resolve("auto", q_len=1, kv_len=9216, dtype=jnp.bfloat16, head_dim=128, backend="gpu") == "xla"
  assert resolve("auto", q_len=1, kv_len=9216, dtype=jnp.bfloat16, head_dim=128, backend="tpu") == "xla"
  # Above: blockwise on CPU and on TPU (where T != S: T = S is splash's, tests/test_attention_splash.py); on GPU
  # cuDNN in half precision when it takes the head size, else blockwise.
  assert resolve("auto", q_len=2, kv_len=limit, dtype=jnp.bfloat16, backend="cpu") == "blockwise"
  assert resolve("auto", q_len=4096, kv_len=4096, dtype=jnp.float32, backend="cpu") == "blockwise"
  assert resolve("auto", q_len=2048, kv_len=4096, dtype=jnp.bfloat16, head_dim=128, backend="tpu") == "blockwise"
  assert resolve("auto", q_len=4096, kv_len=4096, dtype=jnp.bfloat16, head_dim=128, backend="gpu") == "cudnn"
  assert resolve("auto", q_len=4096, kv_len=4096, dtype=jnp.bfloat16, head_dim=132, backend="gpu") == "blockwise"
  assert resolve("auto", q_len=4096, kv_len=4096, dtype=jnp.float32, head_dim=128, backend="gpu") == "blockwise"
  # Explicit choices stand; a wrong name is named.
  for name in ("xla", "blockwise", "cudnn", "splash"):
    assert resolve(name, q_len=4096, kv_len=4096, dtype=jnp.float32) == name
  with pytest.raises(ValueError, match="attention='flash'"):
    resolve("flash", q_len=1, kv_len=1, dtype=jnp.float32)
  # Here (CPU), cuDNN is refused with a line that says why, and attend("auto") traces the path resolve names.
  if jax.default_backend() == "cpu":
    q, k, v, _ = _inputs(1, 3, 3, 2, 1)
    with pytest.raises(ValueError, match="attention='cudnn' needs a GPU backend"):
      attention_lib.attend(q, k, v, jnp.arange(3), jnp.ones((1, 3), bool), implementation="cudnn", block_size=2)

    def loops(length):
      q, k, v, _ = _inputs(1, length, length, 2, 1)
      jaxpr = jax.make_jaxpr(lambda q, k, v: attention_lib.attend(
          q, k, v, jnp.arange(length), jnp.ones((1, length), bool), implementation="auto", block_size=64))(q, k, v)
      return "while" in str(jaxpr)

    side = int(limit ** 0.5)
    assert not loops(side) and loops(side + 1)


_MODEL = ModelConfig(model_type="qwen2", vocab_size=13, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, attention_block_size=4)


def test_model_logits_and_remat_gradients_match_between_paths():
  """The whole decoder (GQA, left padding, T = 10 over key blocks of 4): blockwise gives xla's logits, and with
  remat the gradients of a loss through the model."""
  ids = jax.random.randint(jax.random.key(1), (2, 10), 1, 13)
  mask = jnp.array([[1] * 10, [0] * 3 + [1] * 7])

  def loss_fn(model):
    logp = jax.nn.log_softmax(model(ids[:, :-1], attention_mask=mask[:, :-1]))
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1) * mask[:, 1:, None])

  results = {}
  for implementation in ("xla", "blockwise"):
    model = Transformer(_MODEL.replace(attention=implementation, remat=True), rngs=nnx.Rngs(0))
    logits = nnx.jit(lambda m: m(ids, attention_mask=mask))(model)
    results[implementation] = (logits, *nnx.jit(nnx.value_and_grad(loss_fn))(model))
  (logits_x, loss_x, grads_x), (logits_b, loss_b, grads_b) = results["xla"], results["blockwise"]
  np.testing.assert_allclose(np.asarray(logits_b), np.asarray(logits_x), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(float(loss_b), float(loss_x), rtol=1e-6)
  leaves_x, leaves_b = jax.tree.leaves(grads_x), jax.tree.leaves(grads_b)
  assert len(leaves_x) == len(leaves_b) > 0
  for a, e in zip(leaves_b, leaves_x):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=1e-6, rtol=1e-4)


def test_model_cached_prefill_and_decode_match_between_paths():
  """Prefill 6 tokens into a 9-slot cache, then decode 3: blockwise and xla give the same logits and caches."""
  ids = jax.random.randint(jax.random.key(2), (2, 9), 1, 13)
  full_mask = jnp.array([[1] * 9, [0, 0] + [1] * 7])
  step = nnx.jit(lambda m, tok, msk, c, i: m.hidden(tok, attention_mask=msk, cache=c, cache_index=i))
  outputs = {}
  for implementation in ("xla", "blockwise"):
    model = Transformer(_MODEL.replace(attention=implementation), rngs=nnx.Rngs(0))
    cache = model.init_cache(2, 9)
    hidden, cache = step(model, ids[:, :6], full_mask.at[:, 6:].set(0), cache, jnp.int32(0))
    got = [model.logits(hidden)]
    for index in range(6, 9):
      hidden, cache = step(model, ids[:, index:index + 1], full_mask.at[:, index + 1:].set(0), cache,
                           jnp.int32(index))
      got.append(model.logits(hidden))
    outputs[implementation] = (jnp.concatenate(got, axis=1), cache)
  np.testing.assert_allclose(np.asarray(outputs["blockwise"][0]), np.asarray(outputs["xla"][0]), atol=1e-5,
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(outputs["blockwise"][1][1]["v"]), np.asarray(outputs["xla"][1][1]["v"]),
                             atol=1e-5)


def test_config_names_bad_attention_settings():
  with pytest.raises(ValueError, match="attention='flash'"):
    _MODEL.replace(attention="flash")
  with pytest.raises(ValueError, match="attention_block_size=0"):
    _MODEL.replace(attention_block_size=0)
  assert ModelConfig().attention == "auto" and ModelConfig().attention_block_size == 512
