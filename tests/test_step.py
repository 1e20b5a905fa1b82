"""The jitted update: micro-batching and devices leave it unchanged; the skip rule holds; the policy moves."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlvr import parallel
from jaxrlvr import step as step_lib
from jaxrlvr.models import ModelConfig

_ROWS, _PROMPT, _COMPLETION, _VOCAB = 16, 4, 6, 32
_MODEL = ModelConfig(vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=8, max_position_embeddings=32)


def _config(**train):
  import configs.exgrpo  # pylint: disable=g-import-not-at-top
  config = configs.exgrpo.get_config()
  with config.unlocked():
    config.rollout.max_new_tokens = _COMPLETION
    config.loss.entropy_coef = 0.01
    config.optim.lr = 1e-2
    for k, v in train.items():
      section, key = k.split("__")
      config[section][key] = v
  return config


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, _VOCAB, size=(_ROWS, _PROMPT + _COMPLETION)).astype(np.int32)
  attention = np.ones_like(ids)
  attention[::3, :2] = 0  # left padding of some prompts
  lengths = rng.integers(1, _COMPLETION + 1, size=_ROWS)
  completion_mask = (np.arange(_COMPLETION)[None] < lengths[:, None]).astype(np.float32)
  attention[:, _PROMPT:] = completion_mask
  completion_mask[-2:] = 0  # two filler rows
  replayed = np.zeros(_ROWS, bool)
  replayed[1::4] = True
  return {
      "input_ids": ids, "attention_mask": attention.astype(np.int32), "completion_mask": completion_mask,
      "advantages": np.repeat(rng.normal(size=(_ROWS, 1)), _COMPLETION, 1).astype(np.float32),
      "old_logp": (-rng.uniform(0.5, 3, size=(_ROWS, _COMPLETION))).astype(np.float32),
      "behaviour_logp": (-rng.uniform(0.5, 3, size=(_ROWS, _COMPLETION))).astype(np.float32),
      "replayed": replayed, "clip": ~replayed,
  }


def _run(config, mesh, batch, optimizer=None):
  model = parallel.create_model(_MODEL, mesh, seed=0)
  graphdef, params = nnx.split(model)
  optimizer = optimizer or step_lib.make_optimizer(config)
  state = step_lib.create_state(params, optimizer, mesh)
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  update = step_lib.make_update_fn(graphdef, config, optimizer, state_sharding=state_sharding,
                                   batch_sharding=parallel.batch_sharding(mesh))
  before = jax.device_get(params)  # the update donates `state`
  new_state, metrics, _ = update(state, parallel.shard_batch(batch, mesh))
  return before, new_state, jax.device_get(metrics)


def _fresh_update(config, mesh):
  """A fresh TrainState of the test model (seed 0) on `mesh` and the jitted update of `config` for it."""
  graphdef, params = nnx.split(parallel.create_model(_MODEL, mesh, seed=0))
  optimizer = step_lib.make_optimizer(config)
  state = step_lib.create_state(params, optimizer, mesh)
  update = step_lib.make_update_fn(graphdef, config, optimizer,
                                   state_sharding=jax.tree.map(lambda x: x.sharding, state),
                                   batch_sharding=parallel.batch_sharding(mesh))
  return state, update


def _single_device():
  return parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])


def _assert_params_close(a, b, rtol=1e-5, atol=1e-7):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _gradient(config, mesh, batch):
  """The summed gradient the update applied, read off an SGD step: (params_before - params_after) / lr.

  The huge learning rate makes the step dwarf the parameters, so float32 rounding of params (~1e-9) stays far below
  the gradient's own precision.
  """
  lr = 1e6
  before, state, metrics = _run(config, mesh, batch, optimizer=optax.sgd(lr))
  return jax.tree.map(lambda b, a: (np.asarray(b, np.float64) - np.asarray(a, np.float64)) / lr, before,
                      jax.device_get(state.params)), metrics


def _assert_gradients_equal(a, b):
  # Relative to the largest entry of each tensor: 1e-5 is float32 accumulation-order noise.
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-5 * max(np.abs(y).max(), 1e-12))


def test_update_moves_the_policy_and_reports_metrics():
  before, state, metrics = _run(_config(), _single_device(), _batch())
  assert int(state.step) == 1 and int(state.skipped) == 0
  moved = [np.abs(np.asarray(x) - np.asarray(y)).max() for x, y in
           zip(jax.tree.leaves(before), jax.tree.leaves(state.params))]
  assert max(moved) > 1e-4
  for key in ("loss/policy", "loss/entropy", "optim/grad_norm", "policy/fresh/ratio_mean",
              "policy/replayed/ratio_mean", "policy/clip_frac_high"):
    assert np.isfinite(metrics[key]), key
  assert metrics["policy/replayed/tokens"] > 0 and metrics["optim/skipped"] == 0


@pytest.fixture(scope="module")
def reference_gradient():
  return _gradient(_config(), _single_device(), _batch())


def test_microbatches_give_the_same_gradient(reference_gradient):
  grads, metrics = _gradient(_config(train__num_microbatches=4), _single_device(), _batch())
  _assert_gradients_equal(grads, reference_gradient[0])
  np.testing.assert_allclose(metrics["loss/policy"], reference_gradient[1]["loss/policy"], rtol=1e-5)


# The recommended layouts (docs/design.md, "Parallelism"): pure data (8,1,1), fsdp (1,8,1), fsdp x tensor
# (1,4,2); and all three axes at once.
@pytest.mark.parametrize("shape", [(8, 1, 1), (1, 8, 1), (1, 4, 2), (2, 2, 2)])
def test_sharded_update_equals_single_device(shape, reference_gradient):
  grads, metrics = _gradient(_config(), parallel.make_mesh(*shape), _batch())
  _assert_gradients_equal(grads, reference_gradient[0])
  np.testing.assert_allclose(metrics["loss/policy"], reference_gradient[1]["loss/policy"], rtol=1e-5)


def test_skip_rule_leaves_params_and_counts():
  before, state, metrics = _run(_config(optim__skip_grad_norm=1e-9), _single_device(), _batch())
  _assert_params_close(before, state.params, rtol=0, atol=0)
  # The optimizer's state is as it started (a fresh Adam's is all zeros: step count and moments); a step taken
  # would have counted and moved the moments.
  assert not any(np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(state.opt_state))
  assert int(state.skipped) == 1 and metrics["optim/skipped"] == 1


@pytest.mark.parametrize("devices", [1, 8])
def test_second_update_reuses_the_first_compile(devices):
  """The state `create_state` makes has the placement the update returns, so step 2 does not compile again (it
  did, costing ~5 s of a 90 s run of the embedded default)."""
  config = _config()
  mesh = _single_device() if devices == 1 else parallel.make_mesh(data=8)
  state, update = _fresh_update(config, mesh)
  batch = parallel.shard_batch(_batch(), mesh)
  for _ in range(3):
    state, _, _ = update(state, batch)
  assert update._cache_size() == 1  # pylint: disable=protected-access


def test_score_chunks_take_at_most_a_micro_batch_and_split_every_shard_evenly():
  assert step_lib._num_score_chunks(128, 32, 8) == 4  # the update batch: one micro-batch a pass
  assert step_lib._num_score_chunks(16, 32, 8) == 1  # a few stored answers: one pass, not 4 tiny ones
  assert step_lib._num_score_chunks(48, 32, 8) == 2  # 6 rows a shard: 2 chunks of 3 each
  assert step_lib._num_score_chunks(40, 16, 8) == 5  # 5 rows a shard: 3 and 4 do not divide it
  assert step_lib._num_score_chunks(8, 2, 8) == 1  # a chunk holds at least one row of every shard
  assert step_lib._num_score_chunks(64, 0, 8) == 1  # 0: no limit
  with pytest.raises(ValueError, match="12 rows do not split over the 8 batch shards"):
    step_lib._num_score_chunks(12, 8, 8)


@pytest.mark.parametrize("max_chunk_rows", [0, 8, 4])
def test_chunked_scoring_equals_one_pass(max_chunk_rows):
  mesh = parallel.make_mesh(2, 2, 2)  # 4 batch shards of 4 rows: 16 rows in 1, 2 or 4 passes
  graphdef, params = nnx.split(parallel.create_model(_MODEL, mesh, seed=0))
  batch = parallel.shard_batch(_batch(), mesh)
  one_pass = step_lib.make_score_fn(graphdef, temperature=0.7, batch_sharding=parallel.batch_sharding(mesh))
  chunked = step_lib.make_score_fn(graphdef, temperature=0.7, batch_sharding=parallel.batch_sharding(mesh),
                                   max_chunk_rows=max_chunk_rows)
  for want, got in zip(one_pass(params, batch), chunked(params, batch)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_one_optimizer_step_takes_pi_old_from_its_own_forward_pass():
  """train.num_minibatches=1: an update without old_logp (no scoring pass before it) takes the detached log-probs of
  its own forward pass as pi_old, and gives the parameters, metrics and old log-probs of the update that was handed
  the scoring pass's."""
  config = _config()
  assert config.train.num_minibatches == 1 and not step_lib.needs_score_pass(config)
  mesh = _single_device()
  graphdef, params = nnx.split(parallel.create_model(_MODEL, mesh, seed=0))
  score = step_lib.make_score_fn(graphdef, temperature=config.rollout.temperature,
                                 batch_sharding=parallel.batch_sharding(mesh))
  batch = parallel.shard_batch(_batch(), mesh)
  scored = {**batch, "old_logp": score(params, batch)[0]}
  unscored = {k: v for k, v in batch.items() if k != "old_logp"}
  results = []
  for b in (scored, unscored):
    state, update = _fresh_update(config, mesh)
    results.append(jax.device_get(update(state, b)))
  (want_state, want_metrics, want_old), (got_state, got_metrics, got_old) = results
  np.testing.assert_allclose(got_old, want_old, rtol=1e-5, atol=1e-6)
  # Adam's first step is lr * g / (|g| + eps): about lr for every entry, so the scoring pass's ratios of 1 +- 1e-7
  # move a near-zero gradient entry's step visibly; a thousandth of lr (1e-2) bounds them.
  _assert_params_close(got_state.params, want_state.params, atol=1e-5)
  for k in want_metrics:
    np.testing.assert_allclose(got_metrics[k], want_metrics[k], rtol=1e-4, atol=1e-6, err_msg=k)
  assert got_metrics["policy/fresh/ratio_mean"] == 1.0  # pi / stop_gradient(pi), exactly

  config = _config(train__num_minibatches=2)
  assert step_lib.needs_score_pass(config)
  state, update = _fresh_update(config, mesh)
  with pytest.raises(ValueError, match="train.num_minibatches=2: the batch needs old_logp"):
    update(state, unscored)


def _shared_prompt_batch(group: int) -> dict:
  """`_batch()` with every `group` consecutive rows given the prompt (ids and mask) of the group's first row, as a
  GRPO group's samples have, and without old_logp (one optimizer step takes its own)."""
  batch = {k: v for k, v in _batch().items() if k != "old_logp"}
  for key in ("input_ids", "attention_mask"):
    prompts = batch[key][::group, :_PROMPT]
    batch[key] = batch[key].copy()
    batch[key][:, :_PROMPT] = np.repeat(prompts, group, axis=0)
  return batch


@pytest.mark.parametrize("micro,shape", [(1, (1, 1, 1)), (2, (1, 1, 1)), (2, (1, 2, 2))])
def test_shared_prompts_give_the_update_of_every_row_scored_alone(micro, shape):
  """prompt_group=4: each group's prompt runs once for its 4 rows. The SGD step, the metrics and the old log-probs
  it returns (in the batch's row order, across micro-batches and shards) are those of the update that scores every
  row's own copy."""
  config = _config(train__num_microbatches=micro)
  mesh = parallel.make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])
  assert step_lib.prompt_group_fits(_ROWS, 4, config, parallel.batch_shards(mesh))
  batch = _shared_prompt_batch(4)
  from jaxrlvr import rollout  # pylint: disable=g-import-not-at-top
  assert rollout.prompts_shared(batch, 4) and not rollout.prompts_shared(_batch(), 4)
  lr = 1e6
  results = []
  for group in (1, 4):
    graphdef, params = nnx.split(parallel.create_model(_MODEL, mesh, seed=0))
    optimizer = optax.sgd(lr)
    state = step_lib.create_state(params, optimizer, mesh)
    update = step_lib.make_update_fn(graphdef, config, optimizer,
                                     state_sharding=jax.tree.map(lambda x: x.sharding, state),
                                     batch_sharding=parallel.batch_sharding(mesh), prompt_group=group)
    before = jax.device_get(params)
    new_state, metrics, old_logp = jax.device_get(update(state, parallel.shard_batch(batch, mesh)))
    grads = jax.tree.map(lambda b, a: (np.asarray(b, np.float64) - np.asarray(a, np.float64)) / lr, before,
                         new_state.params)
    results.append((grads, metrics, old_logp))
  (want_grads, want_metrics, want_old), (got_grads, got_metrics, got_old) = results
  _assert_gradients_equal(got_grads, want_grads)
  np.testing.assert_allclose(got_old, want_old, rtol=0, atol=2e-5)
  assert np.all((got_old != 0) == (batch["attention_mask"][:, _PROMPT:] != 0))  # each row's own, in place
  for k in ("loss/policy", "loss/entropy", "optim/grad_norm"):
    np.testing.assert_allclose(got_metrics[k], want_metrics[k], rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("max_chunk_rows", [0, 4])
def test_shared_prompt_scoring_equals_a_prompt_per_row(max_chunk_rows):
  """The scoring pass with prompt_group=4 (each prompt once for its group; 4 groups over 2 batch shards, in 1 or 2
  chunks of whole groups) gives every row's log-probs and entropies in the batch's order."""
  mesh = parallel.make_mesh(1, 2, 1, devices=jax.devices()[:2])
  graphdef, params = nnx.split(parallel.create_model(_MODEL, mesh, seed=0))
  host = _shared_prompt_batch(4)
  batch = parallel.shard_batch(host, mesh)
  make = lambda group: step_lib.make_score_fn(graphdef, temperature=0.7, batch_sharding=parallel.batch_sharding(mesh),
                                              max_chunk_rows=max_chunk_rows, prompt_group=group)
  for want, got in zip(make(1)(params, batch), make(4)(params, batch)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)
    assert np.all((np.asarray(got) != 0) == (host["attention_mask"][:, _PROMPT:] != 0))


def test_prompt_groups_must_split_into_micro_batches_and_shards():
  config = _config(train__num_microbatches=2)
  assert step_lib.prompt_group_fits(16, 4, config, 2)
  assert not step_lib.prompt_group_fits(16, 4, config, 4)  # 4 groups over 2 micro-batches x 4 shards
  assert not step_lib.prompt_group_fits(16, 1, config, 1)  # a group of one shares nothing


@pytest.mark.parametrize("minibatches,micro", [(1, 1), (1, 2), (2, 1)])
def test_packed_completions_give_the_shared_prompt_update(minibatches, micro):
  """The same batch with its answers packed into fewer rows (packing.plan_batch: the fewest each micro-batch fits,
  two prompts a row at most): the SGD step, the metrics and the old log-probs it returns are the unpacked
  shared-prompt update's; another batch packed into as many rows runs the same compiled update."""
  from jaxrlvr import packing  # pylint: disable=g-import-not-at-top
  config = _config(train__num_minibatches=minibatches, train__num_microbatches=micro)
  mesh = _single_device()
  batch = _shared_prompt_batch(4)
  if minibatches > 1:
    batch["old_logp"] = _batch()["old_logp"]
  micro_rows = _ROWS // (minibatches * micro)
  plan_kwargs = dict(prompt_len=_PROMPT, group_size=4, num_minibatches=minibatches, num_microbatches=micro,
                     packed_row_options=range(1, micro_rows), max_prompts=2)
  plan = packing.plan_batch(batch, **plan_kwargs)
  packed_rows = plan["packing"]["ids"].shape[0] // (minibatches * micro)
  assert packed_rows < micro_rows
  lr = 1e6
  results = []
  graphdef, params = nnx.split(parallel.create_model(_MODEL, mesh, seed=0))
  optimizer = optax.sgd(lr)
  update = step_lib.make_update_fn(graphdef, config, optimizer,
                                   state_sharding=jax.tree.map(lambda x: x.sharding,
                                                               step_lib.create_state(params, optimizer, mesh)),
                                   batch_sharding=parallel.batch_sharding(mesh), prompt_group=4)
  for variant in (batch, {**batch, **plan}):
    state = step_lib.create_state(jax.tree.map(lambda x: x.copy(), params), optimizer, mesh)
    new_state, metrics, old_logp = jax.device_get(update(state, parallel.shard_batch(variant, mesh)))
    grads = jax.tree.map(lambda b, a: (np.asarray(b, np.float64) - np.asarray(a, np.float64)) / lr,
                         jax.device_get(params), new_state.params)
    results.append((grads, metrics, old_logp))
  (want_grads, want_metrics, want_old), (got_grads, got_metrics, got_old) = results
  _assert_gradients_equal(got_grads, want_grads)
  np.testing.assert_allclose(got_old, want_old, rtol=0, atol=2e-5)
  for k in ("loss/policy", "loss/entropy", "optim/grad_norm", "policy/clip_frac_low", "policy/tokens"):
    np.testing.assert_allclose(got_metrics[k], want_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
  # Other answers, packed into the same number of rows: no new compile.
  other = _shared_prompt_batch(4)
  lengths = np.random.default_rng(5).integers(1, _COMPLETION + 1, size=_ROWS)
  other["attention_mask"][:, _PROMPT:] = np.arange(_COMPLETION)[None] < lengths[:, None]
  other_plan = packing.plan_batch(other, **{**plan_kwargs, "packed_row_options": [packed_rows]})
  assert other_plan is not None and not np.array_equal(other_plan["unpack"], plan["unpack"])
  if minibatches > 1:
    other["old_logp"] = batch["old_logp"]
  compiled = update._cache_size()  # pylint: disable=protected-access
  state = step_lib.create_state(jax.tree.map(lambda x: x.copy(), params), optimizer, mesh)
  jax.block_until_ready(update(state, parallel.shard_batch({**other, **other_plan}, mesh)))
  assert update._cache_size() == compiled  # pylint: disable=protected-access
