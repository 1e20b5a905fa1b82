"""The supervised warm start: it lowers the completions' loss, and its step compiles once however many steps run."""
import dataclasses
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlvr import models
from jaxrlvr import parallel
from jaxrlvr import step as step_lib
from jaxrlvr import warm_start
from jaxrlvr.models import ModelConfig

_MODEL = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=32)
_PAIRS = [([1, 2, 3], [4, 5, 6, 7]), ([8, 9], [10, 11]), ([12], [13, 14, 15])]


def _completion_nll(model, mesh) -> float:
  batch = warm_start.pack_sequences(_PAIRS, prompt_len=4, completion_len=4, pad_id=0)
  logp, _ = step_lib.completion_logprobs(model, parallel.shard_batch(
      {k: v[[0, 1, 2, 0]] for k, v in batch.items()}, mesh), 1.0)  # 4 rows: they split over 1, 2 or 4 shards
  mask = jnp.asarray(batch["completion_mask"][[0, 1, 2, 0]])
  return float(-jnp.sum(logp * mask) / jnp.sum(mask))


def test_first_fit_rows_packs_the_longest_first():
  assert warm_start.first_fit_rows([5, 3, 4, 2], row_len=7) == [0, 1, 1, 0]  # 5 + 2 and 4 + 3
  assert warm_start.first_fit_rows([7, 7, 1], row_len=7) == [0, 1, 2]
  with pytest.raises(ValueError, match="8 tokens does not fit a row of 7"):
    warm_start.first_fit_rows([8], row_len=7)


def test_packed_rows_train_as_one_pair_a_row():
  """The same pairs packed several to a row (`pack_rows`) and one to a row (`pack_sequences`): the same loss and, one
  SGD step on, the same parameters, on half the rows."""
  packed = warm_start.pack_rows(_PAIRS, row_len=8, num_rows=2, pad_id=0)  # 7, 4 and 4 tokens: 7 | 4 + 4
  assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 10, 11, 12, 13, 14, 15]]
  assert packed["segment_ids"].tolist() == [[1] * 7 + [0], [1] * 4 + [2] * 4]
  assert packed["positions"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 0], [0, 1, 2, 3, 0, 1, 2, 3]]
  assert packed["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 1, 1, 1]]
  with pytest.raises(ValueError, match="3 pairs take 2 packed rows, more than the 1 given"):
    warm_start.pack_rows(_PAIRS, row_len=8, num_rows=1, pad_id=0)

  mesh = parallel.make_mesh(data=1, devices=jax.devices()[:1])
  padded = warm_start.pack_sequences(_PAIRS, prompt_len=4, completion_len=4, pad_id=0)
  results = []
  for batch in (padded, packed):
    graphdef, params = nnx.split(parallel.create_model(_MODEL, mesh, seed=0))
    optimizer = optax.sgd(1.0)
    opt_state = step_lib.init_optimizer_state(params, optimizer, mesh)
    sft_step = warm_start.make_sft_step(graphdef, optimizer, param_sharding=jax.tree.map(lambda x: x.sharding, params),
                                        opt_sharding=jax.tree.map(lambda x: x.sharding, opt_state),
                                        batch_sharding=parallel.batch_sharding(mesh))
    results.append(sft_step(params, opt_state, parallel.shard_batch(batch, mesh)))
  (params_a, _, loss_a), (params_b, _, loss_b) = results
  np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("devices", [1, 4])
def test_warm_start_learns_and_compiles_its_step_once(devices, monkeypatch):
  mesh = parallel.make_mesh(data=devices, devices=jax.devices()[:devices])
  model = parallel.create_model(_MODEL, mesh, seed=0)
  before = _completion_nll(model, mesh)
  steps = []
  make_step = warm_start.make_sft_step
  monkeypatch.setattr(warm_start, "make_sft_step", lambda *a, **k: steps.append(make_step(*a, **k)) or steps[-1])
  trained = warm_start.train_supervised(model, _PAIRS, steps=40, lr=1e-2, batch_size=4, seed=0, prompt_len=4,
                                        completion_len=4, pad_id=0, batch_sharding=parallel.batch_sharding(mesh),
                                        log_every=0)
  # The optimizer state starts placed as the step returns it; before, the second step compiled again (~1 s).
  assert len(steps) == 1 and steps[0]._cache_size() == 1
  after = _completion_nll(trained, mesh)
  assert after < 0.5 * before, (before, after)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(nnx.state(trained)))


class _Vocab:
  pad_token_id = 0

  def get_vocab(self):
    return {"a": 0, "b": 1}


@dataclasses.dataclass
class _Pairs:
  """`warm_start.PairSource`'s interface over fixed pairs; records how many each `take` asked for."""
  pairs: list
  completion_len: int = 4
  tokenizer: _Vocab = dataclasses.field(default_factory=_Vocab)
  taken: list = dataclasses.field(default_factory=list)

  @property
  def count(self):
    return len(self.pairs)

  def take(self, n):
    self.taken.append(n)
    return self.pairs[:n]


def test_cache_key_ignores_how_the_model_is_computed():
  """The attention kernel, its block size and remat change no weight the warm start learns, so they share a cache
  entry; the architecture, the data and the optimisation do not."""
  config = models.get_preset("tiny")
  pairs = [([1, 2], [3])]
  key = lambda cfg, **kw: warm_start.cache_key(cfg, _Vocab(), pairs, num_pairs=kw.get("num_pairs", 1), task="t",
                                               steps=kw.get("steps", 10), lr=1e-3, batch_size=4, seed=0)
  base = key(config)
  for same in (dict(attention="blockwise"), dict(attention="xla", attention_block_size=64), dict(remat=True),
               dict(scan_layers=True)):
    assert key(dataclasses.replace(config, **same)) == base, same
  assert key(dataclasses.replace(config, hidden_size=config.hidden_size * 2)) != base
  assert key(config, steps=11) != base
  assert key(config, num_pairs=2) != base


def test_runs_started_together_train_a_warm_start_once(tmp_path, monkeypatch):
  """Two runs that want the same entry at once (the arms of `compare --parallel=2`, a test run's two workers): one
  trains it, the other waits on the entry's lock and then reads it, and both get the same weights. The one that
  reads neither initialises a model nor tokenises more than the cache key's sample of its pairs."""
  mesh = parallel.make_mesh(data=1, devices=jax.devices()[:1])
  trained, started = [], threading.Event()

  def train(model, pairs, **kwargs):
    del pairs, kwargs
    trained.append(threading.get_ident())
    started.set()
    time.sleep(2.0)  # the other run finds the entry missing and the lock taken
    return model

  monkeypatch.setattr(warm_start, "train_supervised", train)
  results, pairs = {}, {"first": _Pairs(_PAIRS), "second": _Pairs(_PAIRS)}
  make_model = {"first": lambda: parallel.create_model(_MODEL, mesh, seed=0),
                "second": lambda: pytest.fail("a cached warm start initialised a model")}

  def run(name):
    results[name] = warm_start.cached_warm_start(
        make_model[name], _MODEL, pairs[name], task="t", steps=3, lr=1e-3, batch_size=2, seed=0, prompt_len=4,
        cache_dir=str(tmp_path), mesh=mesh)

  first = threading.Thread(target=run, args=("first",))
  first.start()
  assert started.wait(30)
  run("second")  # what it returns must be the first run's entry
  first.join()
  assert len(trained) == 1
  assert pairs["first"].taken == [warm_start.KEY_SAMPLE, 3] and pairs["second"].taken == [warm_start.KEY_SAMPLE]
  (entry,) = [e for e in os.listdir(tmp_path) if not e.startswith(".")]
  assert sorted(os.listdir(tmp_path)) == sorted([entry, f".{entry}.lock"])  # no half-written copy left beside it
  for a, b in zip(jax.tree.leaves(nnx.state(results["first"])), jax.tree.leaves(nnx.state(results["second"]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
