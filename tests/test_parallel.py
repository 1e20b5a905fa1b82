"""Mesh construction, logical-axis rules, sharded creation and a sharded forward equal to the single-device one
(8 fake CPU devices from conftest)."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrlvr import parallel
from jaxrlvr.models import Transformer, get_preset, load_pretrained, save_pretrained

_CONFIG = get_preset("tiny").replace(num_layers=1)


def test_make_mesh_fills_and_uses_auto_axes():
  assert jax.device_count() == 8
  mesh = parallel.make_mesh(data=-1, fsdp=2, tensor=2)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert dict(parallel.make_mesh().shape) == {"data": 8, "fsdp": 1, "tensor": 1}


def test_make_mesh_errors_name_the_sizes():
  with pytest.raises(ValueError, match="data=2 x fsdp=3 x tensor=1 = 6 devices, but there are 8"):
    parallel.make_mesh(data=2, fsdp=3, tensor=1)
  with pytest.raises(ValueError, match="multiply to 3, which does not divide the 8 devices"):
    parallel.make_mesh(data=-1, fsdp=3)


def test_logical_to_spec_rules_and_fallbacks():
  mesh = parallel.make_mesh(data=1, fsdp=2, tensor=4)
  # q_proj [D=128, N=4, H=32]: embed over fsdp (128 % 2 == 0), heads over tensor (4 % 4 == 0).
  assert parallel.logical_to_spec(("embed", "q_heads", "head_dim"), (128, 4, 32), mesh) == P("fsdp", "tensor", None)
  # 2 kv heads on a tensor axis of 4 do not divide: replicated on that dim instead of failing.
  assert parallel.logical_to_spec(("embed", "kv_heads", "head_dim"), (128, 2, 32), mesh) == P("fsdp", None, None)
  # batch -> (data, fsdp); data has size 1 and is dropped, so only fsdp remains.
  assert parallel.logical_to_spec(("batch",), (6,), mesh) == P("fsdp")
  mesh2 = parallel.make_mesh(data=2, fsdp=4, tensor=1)
  assert parallel.logical_to_spec(("batch",), (16,), mesh2) == P(("data", "fsdp"))
  # 6 rows: data*fsdp = 8 does not divide 6, data = 2 does: the leading axis is kept.
  assert parallel.logical_to_spec(("batch",), (6,), mesh2) == P("data")
  with pytest.raises(KeyError, match="logical axis 'embedding' has no rule"):
    parallel.logical_to_spec(("embedding",), (128,), mesh)


@pytest.mark.parametrize("shape", [(1, 2, 4), (2, 4, 1)])
def test_sharded_forward_equals_single_device(shape):
  reference = Transformer(_CONFIG, rngs=nnx.Rngs(0))
  mesh = parallel.make_mesh(*shape)
  model = parallel.create_model(_CONFIG, mesh, seed=0)  # same seed: the same weights, created sharded

  q_proj = model.layers[0].attn.q_proj[...]
  assert q_proj.sharding.spec == parallel.logical_to_spec(("embed", "q_heads", "head_dim"), q_proj.shape, mesh)
  assert len(q_proj.sharding.device_set) == 8

  ids = jax.random.randint(jax.random.key(0), (8, 6), 1, _CONFIG.vocab_size)
  mask = jnp.ones((8, 6), jnp.int32).at[1, :2].set(0)
  forward = nnx.jit(lambda m, x, msk: m(x, attention_mask=msk))
  expected = forward(reference, ids, mask)
  got = forward(model, parallel.shard_batch(ids, mesh), parallel.shard_batch(mask, mesh))
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=1e-5)


def test_model_from_config_loads_each_tensor_onto_its_shard(tmp_path):
  mesh = parallel.make_mesh(data=1, fsdp=2, tensor=4)
  save_pretrained(Transformer(_CONFIG, rngs=nnx.Rngs(0)), _CONFIG, str(tmp_path))
  run = ml_collections.ConfigDict({"seed": 0, "model": {
      "preset": "tiny", "path": str(tmp_path), "param_dtype": "float32", "compute_dtype": "float32",
      "attention": "auto", "attention_block_size": 512, "remat": True}})
  model, model_config = parallel.model_from_config(run, mesh)
  assert model_config == _CONFIG.replace(remat=True)
  embed = model.embed[...]  # [V=64, D=128] -> P('tensor', 'fsdp'): each device holds a [16, 64] block
  assert embed.sharding.spec == P("tensor", "fsdp")
  assert {s.data.shape for s in embed.addressable_shards} == {(16, 64)}


def test_describe_sharding_and_param_count():
  mesh = parallel.make_mesh(data=1, fsdp=2, tensor=4)
  model = parallel.create_model(_CONFIG, mesh)
  table = parallel.describe_sharding(model)
  assert "layers.0.attn.q_proj" in table and "('embed', 'q_heads', 'head_dim')" in table
  assert "P('fsdp', 'tensor', None)" in table
  # 8,192 + 128 + 246,272 (one layer, see test_model.test_tiny_preset_count_by_hand) = 254,592.
  assert parallel.param_count(model) == 254_592
  abstract = nnx.eval_shape(lambda: Transformer(_CONFIG, rngs=nnx.Rngs(0)))
  assert parallel.param_count(abstract) == 254_592
  assert "P('fsdp', None, None)" in parallel.describe_sharding(abstract, mesh)
  assert parallel.batch_sharding(mesh).spec == P(("data", "fsdp")) and parallel.replicated(mesh).spec == P()
