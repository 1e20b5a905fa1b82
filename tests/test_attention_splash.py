"""models/splash.py: JAX's splash-attention kernel gives the xla path's values and gradients in Pallas' interpreter
(left-padded and packed rows, under a shard_map on a CPU mesh), "auto" picks it from the mesh's platform, and a model
layer with attention="auto" compiles through Mosaic for a TPU topology."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrlvr import parallel
from jaxrlvr.models import ModelConfig, Transformer
from jaxrlvr.models import attention as attention_lib
from jaxrlvr.models import sharding as sharding_lib
from jaxrlvr.models import splash as splash_lib


def _inputs(b, t, n, kv, h=8, seed=0):
  """q [B, T, N, H], k/v [B, K, T, H] and an output cotangent [B, T, N, H], float32."""
  keys = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(keys[0], (b, t, n, h)), jax.random.normal(keys[1], (b, kv, t, h)),
          jax.random.normal(keys[2], (b, kv, t, h)), jax.random.normal(keys[3], (b, t, n, h)))


def _value_and_grads(implementation, q, k, v, cotangent, key_mask, block_size):
  def loss(q, k, v):
    out = attention_lib.attend(q, k, v, jnp.arange(q.shape[1]), key_mask, implementation=implementation,
                               block_size=block_size)
    return jnp.sum(out * cotangent), out

  return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)


@jax.jit
def _masks(key_mask):
  """[B, T, T] twice: what splash lets each query see under `segment_ids` (causal, same id), and what the xla path
  lets it see (`attention_weights_mask`)."""
  query_ids, key_ids = splash_lib.segment_ids(key_mask)
  slots = jnp.arange(key_mask.shape[1])
  splash = (slots[None, :] <= slots[:, None])[None] & (query_ids[:, :, None] == key_ids[:, None, :])
  return splash, attention_lib.attention_weights_mask(slots, key_mask)


def test_segment_ids_give_the_masking_rules():
  """The ids splash is given allow exactly `attention_weights_mask`'s keys: every query of a boolean mask (left,
  right and inner padding, a row of padding only), and every real query of packed rows."""
  boolean = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 1, 1, 0, 1], [0] * 8], bool)
  np.testing.assert_array_equal(*_masks(boolean))
  packed = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [0, 0, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
  got, expected = (np.asarray(m) for m in _masks(packed))
  np.testing.assert_array_equal(got[packed > 0], expected[packed > 0])
  # A packed row's trailing padding query sees the last segment (the xla path: every real key before it); one before
  # any real key, its own slot. No query sees another's padding key.
  np.testing.assert_array_equal(got[0, 6], [0, 0, 0, 0, 0, 1, 0, 0])
  np.testing.assert_array_equal(got[1, 1], [0, 1, 0, 0, 0, 0, 0, 0])
  assert got.any(axis=-1).all()  # no empty row


def test_splash_equals_xla_on_padded_and_packed_rows_under_a_mesh():
  """Pallas' interpreter under a shard_map on a 1 x 2 x 2 CPU mesh (rows over 'fsdp'; 4 query heads and 2 kv heads
  over 'tensor', so each shard runs the kernel's own GQA grouping), T = 200 padded to two 128-slot blocks. Rows: 3
  and 150 left pads (the first 150 queries see their own slot only), packed sequences with trailing padding, left
  padding before packed sequences. Outputs and gradients match the xla path's, except on the packed row's trailing
  padding queries (splash shows them the last segment, the xla path every earlier real key): their cotangent is
  zero, as the model's loss leaves it, and their outputs only need to be finite."""
  mesh = parallel.make_mesh(1, 2, 2, devices=jax.devices()[:4])
  b, t, n, kv = 4, 200, 4, 2
  q, k, v, cotangent = _inputs(b, t, n, kv)
  segments = np.array([[0] * 3 + [1] * 197, [0] * 150 + [1] * 50, [1] * 60 + [2] * 70 + [3] * 50 + [0] * 20,
                       [0] * 10 + [1] * 90 + [2] * 100], np.int32)
  compared = ~((segments == 0) & (np.cumsum(segments > 0, axis=1) > 0))  # not a padding query after real keys
  cotangent = cotangent * compared[:, :, None, None]
  rows_heads = NamedSharding(mesh, PartitionSpec(sharding_lib.BATCH_AXES, None, "tensor"))
  rows_kv_heads = NamedSharding(mesh, PartitionSpec(sharding_lib.BATCH_AXES, "tensor"))
  rows = NamedSharding(mesh, PartitionSpec(sharding_lib.BATCH_AXES))
  q, cotangent = jax.device_put(q, rows_heads), jax.device_put(cotangent, rows_heads)
  k, v, key_mask = jax.device_put(k, rows_kv_heads), jax.device_put(v, rows_kv_heads), jax.device_put(segments, rows)
  run = jax.jit(_value_and_grads, static_argnums=(0, 6))
  (_, out_x), grads_x = run("xla", q, k, v, cotangent, key_mask, 128)
  lowered = run.lower("splash", q, k, v, cotangent, key_mask, 128)
  assert "manual_computation" in lowered.as_text()  # the kernel ran under a shard_map, on the mesh q came on
  (_, out), grads = lowered.compile()(q, k, v, cotangent, key_mask)
  assert out.shape == (b, t, n, 8) and bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_allclose(np.asarray(out)[compared], np.asarray(out_x)[compared], atol=2e-5, rtol=2e-5)
  for name, a, e in zip(("dq", "dk", "dv"), grads, grads_x):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=2e-5, rtol=2e-5, err_msg=name)
  assert all(float(jnp.abs(g).max()) > 1e-2 for g in grads)


def test_auto_picks_splash_on_tpu_for_self_attention_only():
  resolve = attention_lib.resolve
  for length in (8, 4096):
    assert resolve("auto", q_len=length, kv_len=length, dtype=jnp.bfloat16, head_dim=128, backend="tpu") == "splash"
  # Decode steps and prefill chunks (T != S) and per-query masks keep the other rules.
  assert resolve("auto", q_len=1, kv_len=4096, dtype=jnp.bfloat16, backend="tpu") == "xla"
  assert resolve("auto", q_len=2048, kv_len=4096, dtype=jnp.bfloat16, backend="tpu") == "blockwise"
  assert resolve("auto", q_len=64, kv_len=64, dtype=jnp.bfloat16, backend="tpu", per_query_mask=True) == "xla"
  assert resolve("auto", q_len=4096, kv_len=4096, dtype=jnp.bfloat16, backend="cpu") == "blockwise"
  # An explicit "splash" where the kernel cannot go says so.
  q, kv = jnp.zeros((1, 2, 2, 8)), jnp.zeros((1, 1, 6, 8))  # a chunk of 2 queries at slots 4, 5 of a cache of 6
  with pytest.raises(ValueError, match="splash attention takes T = S"):
    attention_lib.attend(q, kv, kv, jnp.arange(4, 6), jnp.ones((1, 6), bool), implementation="splash",
                         block_size=128)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]'): no TPU compiler to compile for")
def test_model_layer_compiles_through_mosaic_for_a_tpu_topology(monkeypatch):
  """One decoder layer with attention="auto", forward and backward in bfloat16, compiled for 4 compile-only v5e
  chips on a 1 x 2 x 2 mesh (rows over 'fsdp', heads and kv heads over 'tensor'): "auto" must read the TPU from the
  mesh (this process's backend is the CPU) and the splash kernels (forward, dq, dkv) must lower through Mosaic."""
  # Read when libtpu loads: no cloud metadata server to ask for the host's TPU, and no one-process-per-TPU lock (two
  # test workers may both load it).
  monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
  mesh = parallel.make_mesh(1, 2, 2, devices=topology.devices)
  config = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                       param_dtype="bfloat16", compute_dtype="bfloat16")
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  abstract.activation_sharding = NamedSharding(mesh, PartitionSpec(sharding_lib.BATCH_AXES))
  graphdef, state = nnx.split(abstract)
  params = jax.tree.map(lambda var, spec: jax.ShapeDtypeStruct(var.shape, var.dtype,
                                                               sharding=NamedSharding(mesh, spec)),
                        state, sharding_lib.param_specs(state, mesh))
  rows = NamedSharding(mesh, PartitionSpec(sharding_lib.BATCH_AXES))
  ids = jax.ShapeDtypeStruct((2, 128), jnp.int32, sharding=rows)
  mask = jax.ShapeDtypeStruct((2, 128), jnp.int32, sharding=rows)

  def loss(params, ids, mask):
    logits = nnx.merge(graphdef, params)(ids, attention_mask=mask)
    return jnp.mean(logits.astype(jnp.float32) * mask[:, :, None])

  compiled = jax.jit(jax.grad(loss)).lower(params, ids, mask).compile()
  assert compiled.as_text().count("tpu_custom_call") >= 3
