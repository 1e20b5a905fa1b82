"""The NNX decoder: KV-cache equivalence, padding semantics, dtypes, remat, presets (eval_shape only), config errors."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import config_lib
from jaxrlvr.models import PRESETS, ModelConfig, Transformer, from_config, get_preset
from jaxrlvr.models import transformer as transformer_lib

_VOCAB = 13
# Small enough to be instant, but with GQA (4 query heads on 2 kv heads), q/k/v bias and 2 layers.
_SMALL = ModelConfig(model_type="qwen2", vocab_size=_VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)


def _model(config=_SMALL, seed=0):
  return Transformer(config, rngs=nnx.Rngs(seed))


@nnx.jit
def _forward(model, ids, attention_mask=None, positions=None):
  return model(ids, attention_mask=attention_mask, positions=positions)


def _ids(shape, seed=1):
  return jax.random.randint(jax.random.key(seed), shape, 1, _VOCAB)


@pytest.mark.parametrize("config", [_SMALL, _SMALL.replace(model_type="qwen3", qkv_bias=False, qk_norm=True,
                                                           tie_embeddings=False)], ids=["qwen2", "qwen3"])
def test_cached_prefill_and_decode_match_uncached_forward(config):
  """Prefill 4 tokens into a 10-slot cache, then decode 3 one at a time: same logits as one uncached forward."""
  model = _model(config)
  b, prompt, steps, slots = 2, 4, 3, 10
  ids = _ids((b, prompt + steps))
  # Row 1 is left-padded by two slots, as the sampler lays out ragged prompts.
  mask = jnp.array([[1] * (prompt + steps), [0, 0] + [1] * (prompt + steps - 2)])
  expected = _forward(model, ids, mask)  # [B, T, V]

  full_mask = jnp.pad(mask, ((0, 0), (0, slots - prompt - steps)))  # [B, S]
  cache = model.init_cache(b, slots)
  step = nnx.jit(lambda m, tok, msk, c, i: m.hidden(tok, attention_mask=msk, cache=c, cache_index=i))
  hidden, cache = step(model, ids[:, :prompt], full_mask.at[:, prompt:].set(0), cache, jnp.int32(0))
  got = [model.logits(hidden)]
  for t in range(steps):
    index = prompt + t
    hidden, cache = step(model, ids[:, index:index + 1], full_mask.at[:, index + 1:].set(0), cache, jnp.int32(index))
    got.append(model.logits(hidden))
  got = jnp.concatenate(got, axis=1)
  assert len(cache) == config.num_layers and cache[0]["k"].shape == (b, 2, slots, 8)  # [B, K, S, H]
  real = np.asarray(mask, bool)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=1e-5, rtol=1e-5)


def test_left_padding_with_mask_equals_unpadded_row():
  """Default positions are cumsum(mask) - 1, so a left-padded row gives the logits of the same row unpadded."""
  model = _model()
  ids = _ids((1, 5))
  alone = _forward(model, ids)  # [1, 5, V]
  padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), ids], axis=1)  # [1, 8]
  mask = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
  logits = _forward(model, padded, mask)
  assert np.all(np.isfinite(np.asarray(logits))), "fully masked padding queries must not give NaN"
  np.testing.assert_allclose(np.asarray(logits[:, 3:]), np.asarray(alone), atol=1e-5, rtol=1e-5)


def test_packed_rows_give_each_sequence_its_own_hidden_states():
  """Sequences packed one after another in a row (segment ids, each its own positions) get the hidden states they get
  alone, with padding after them and in a second row; blockwise attention, which takes no segments, says so."""
  model = _model()
  first, second, third = _ids((1, 5), seed=1), _ids((1, 4), seed=2), _ids((1, 7), seed=3)
  ids = jnp.zeros((2, 11), jnp.int32)
  ids = ids.at[0, :5].set(first[0]).at[0, 5:9].set(second[0]).at[1, :7].set(third[0])
  segment_ids = jnp.array([[1] * 5 + [2] * 4 + [0] * 2, [1] * 7 + [0] * 4])
  positions = jnp.array([list(range(5)) + list(range(4)) + [0, 0], list(range(7)) + [0] * 4])
  hidden = nnx.jit(lambda m, i, s, p: m.hidden(i, segment_ids=s, positions=p)[0])(model, ids, segment_ids, positions)
  for alone, (row, start) in zip((first, second, third), ((0, 0), (0, 5), (1, 0))):
    expected, _ = nnx.jit(lambda m, i: m.hidden(i))(model, alone)
    got = hidden[row, start:start + alone.shape[1]]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected[0]), atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="blockwise attention takes no segment ids"):
    _model(_SMALL.replace(attention="blockwise")).hidden(ids, segment_ids=segment_ids, positions=positions)
  with pytest.raises(ValueError, match="segment_ids"):
    model.hidden(ids, segment_ids=segment_ids)  # no positions


def test_explicit_positions_feed_rope():
  """RoPE scores depend on relative positions: a uniform shift changes nothing, a stretch changes the logits."""
  model = _model()
  ids = _ids((2, 6))
  default = _forward(model, ids)
  shifted = _forward(model, ids, positions=jnp.broadcast_to(jnp.arange(6) + 5, (2, 6)))
  stretched = _forward(model, ids, positions=jnp.broadcast_to(jnp.arange(6) * 2, (2, 6)))
  np.testing.assert_allclose(np.asarray(shifted), np.asarray(default), atol=1e-5)
  # Random init (std 0.02) makes attention nearly uniform, so the change is small (~6e-4) but far above float noise.
  assert np.abs(np.asarray(stretched) - np.asarray(default)).max() > 1e-4


def test_bf16_params_and_compute_give_float32_logits():
  config = _SMALL.replace(param_dtype="bfloat16", compute_dtype=jnp.bfloat16)
  model = _model(config)
  assert model.embed[...].dtype == jnp.bfloat16
  assert model.unembedding().dtype == jnp.bfloat16 and model.unembedding().shape == (32, _VOCAB)
  logits = _forward(model, _ids((2, 5)))
  assert logits.dtype == jnp.float32 and logits.shape == (2, 5, _VOCAB)
  cache = model.init_cache(2, 8)
  assert cache[0]["k"].dtype == jnp.bfloat16


def test_untied_head_and_remat_gradients():
  """remat changes memory, not values: same loss and gradients with and without it."""
  config = _SMALL.replace(tie_embeddings=False)
  ids = _ids((2, 6))

  def loss_fn(model):
    logp = jax.nn.log_softmax(model(ids[:, :-1]))
    return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

  plain, remat = _model(config), _model(config.replace(remat=True))
  assert hasattr(plain, "lm_head") and plain.unembedding().shape == (32, _VOCAB)
  grad_fn = nnx.jit(nnx.value_and_grad(loss_fn))
  loss_a, grads_a = grad_fn(plain)
  loss_b, grads_b = grad_fn(remat)
  np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  assert np.abs(np.asarray(grads_a["lm_head"][...])).max() > 0


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_swiglu_vjp_equals_autodiff(dtype, atol):
  """The hand-written SwiGLU backward pass gives autodiff's gradients for every input (float32 tightly; bfloat16
  within its rounding), and the same output."""
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (3, 5, 16)).astype(dtype)
  w_gate, w_up = ((0.3 * jax.random.normal(k, (16, 24))).astype(dtype) for k in keys[1:3])
  w_down = (0.3 * jax.random.normal(keys[3], (24, 16))).astype(dtype)
  cotangent = jax.random.normal(keys[4], (3, 5, 16)).astype(dtype)

  def plain(x, w_gate, w_up, w_down):
    return jnp.einsum("BTF,FD->BTD", jax.nn.silu(x @ w_gate) * (x @ w_up), w_down)

  def loss(f):
    return lambda *args: jnp.sum((f(*args) * cotangent).astype(jnp.float32))

  args = (x, w_gate, w_up, w_down)
  np.testing.assert_allclose(np.asarray(transformer_lib.swiglu(*args), np.float32),
                             np.asarray(plain(*args), np.float32), atol=atol)
  ours = jax.jit(jax.grad(loss(transformer_lib.swiglu), argnums=(0, 1, 2, 3)))(*args)
  reference = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2, 3)))(*args)
  for name, a, b in zip(("x", "w_gate", "w_up", "w_down"), ours, reference):
    assert a.dtype == dtype, name
    scale = float(np.abs(np.asarray(b, np.float32)).max())
    np.testing.assert_allclose(np.asarray(a, np.float32) / scale, np.asarray(b, np.float32) / scale, atol=atol,
                               err_msg=name)


def test_attention_layout_matches_jax_dot_product_attention():
  """The einsum path equals jax.nn.dot_product_attention with the arguments the 'cudnn' path passes it (here run
  with XLA), including GQA and a left-padded row whose first queries see no real key."""
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (2, 5, 4, 8))  # [B, T, N, H]
  k = jax.random.normal(kk, (2, 7, 2, 8))  # [B, S, K, H]
  v = jax.random.normal(kv, (2, 7, 2, 8))
  mask = transformer_lib.attention_weights_mask(jnp.arange(5) + 2, jnp.array([[1] * 7, [0, 0, 0, 0, 0, 1, 1]]))
  # Ours takes keys and values heads-first, the KV cache's layout: [B, K, S, H].
  ours = transformer_lib.dot_product_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), mask, implementation="xla")
  reference = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=8 ** -0.5, implementation="xla")
  np.testing.assert_allclose(np.asarray(ours), np.asarray(reference), atol=1e-6)
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="attention='cudnn' needs a GPU backend"):
      transformer_lib.dot_product_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), mask, implementation="cudnn")


def _count(config: ModelConfig) -> int:
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("name,published", [("qwen2.5-math-1.5b", 1.54e9), ("qwen2.5-math-7b", 7.62e9),
                                            ("llama3.1-8b", 8.03e9), ("qwen3-4b", 4.02e9)])
def test_preset_parameter_counts(name, published):
  """Full-size presets through eval_shape only (no memory): within 1% of the published counts."""
  assert abs(_count(get_preset(name)) - published) / published < 0.01


def test_tiny_preset_count_by_hand():
  # embed 64*128 = 8,192; final norm 128.
  # per layer: q 128*128 + 128 bias = 16,512; k, v 128*64 + 64 = 8,256 each; o 128*128 = 16,384;
  #            MLP 3*128*512 = 196,608; two norms 256 -> 246,272; 4 layers -> 985,088.
  # total 8,192 + 128 + 985,088 = 993,408.
  assert _count(get_preset("tiny")) == 993_408


def test_every_parameter_has_logical_axis_names():
  known = {"vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "norm"}
  model = _model(_SMALL.replace(qk_norm=True, tie_embeddings=False))
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = var.get_metadata().get("out_sharding")
    assert names is not None and len(names) == var.ndim and set(names) <= known, (path, names)


def test_llama3_rope_scaling_frequencies_by_hand():
  """theta 10000, head_dim 8: inv_freq = [1, 0.1, 0.01, 0.001]; wavelengths 2*pi/f = 6.28, 62.8, 628, 6283.

  llama3 with original length 256, low 1, high 4, factor 8: wavelen > 256 (last two) is divided by 8;
  wavelen < 64 (first two) stays. None falls in the medium band [64, 256], so the result is exact.
  """
  config = _SMALL.replace(model_type="llama", qkv_bias=False, rope_theta=10000.0, rope_scaling={
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 256})
  np.testing.assert_allclose(transformer_lib.rope_inv_freq(config), [1.0, 0.1, 0.01 / 8, 0.001 / 8], rtol=1e-6)


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="num_heads \\(6\\).*num_kv_heads \\(4\\)"):
    _SMALL.replace(num_heads=6, num_kv_heads=4)
  with pytest.raises(ValueError, match="model_type='gpt2'"):
    _SMALL.replace(model_type="gpt2")
  with pytest.raises(ValueError, match="attention='flash'"):
    _SMALL.replace(attention="flash")
  with pytest.raises(config_lib.ConfigError, match="'qwen9'.*tiny"):
    get_preset("qwen9")


def test_config_is_hashable_and_reads_run_config():
  assert hash(PRESETS["llama3.1-8b"]) == hash(PRESETS["llama3.1-8b"].replace())
  run = ml_collections.ConfigDict({"model": {"preset": "tiny", "path": "", "param_dtype": "float32",
                                             "compute_dtype": "bfloat16", "attention": "xla", "remat": True}})
  config = from_config(run)
  assert config.compute_dtype == "bfloat16" and config.remat and config.hidden_size == 128
