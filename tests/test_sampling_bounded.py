"""The sampler's memory bounds: calls of at most max_rows_per_device rows, and a prefill in blocks of rows and chunks
of tokens, give the samples of the unbounded call; and the rollout.* keys reach every sampler call."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import two_processes
from configs import grpo
from jaxrlvr import config_lib
from jaxrlvr import parallel
from jaxrlvr import replay
from jaxrlvr import rollout
from jaxrlvr import run_setup
from jaxrlvr import train
from jaxrlvr.models import ModelConfig, Transformer
from jaxrlvr.rewards import judge as judge_lib
from jaxrlvr.rollout import bounded
from jaxrlvr.rollout import sampler

# The model of tests/test_sampling.py: peaked next-token distributions, so greedy has no ties.
_CONFIG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, initializer_range=0.3)
# 7 ragged prompts (longest 12: bucket 16): 3 rows a call leave a last call of 1 prompt and 2 padding rows.
_PROMPTS = [[3, 14, 15, 9, 2, 6, 5], [35], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6], [43, 38], [1, 2, 3, 4, 5],
            [60, 61, 62], [7] * 9]
_NEW = 6
_EOS = (38, 33, 61)  # tokens this model emits: rows stop at different steps, greedy and sampled


@pytest.fixture(scope="module")
def model():
  return Transformer(_CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def two_device_mesh():
  return parallel.make_mesh(data=2, fsdp=1, tensor=1, devices=jax.devices()[:2])


def _on_mesh(model, mesh):
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.device_put(state, parallel.param_shardings(state, mesh)))


# Float32 values to a few ulp: XLA:CPU compiles the same math at another batch shape, or inside the prefill's loop,
# with a different rounding (log-probs reach -5 here, whose ulp is 5e-7), and how much depends on the CPU: an AMD
# EPYC matched to 1e-6, an Intel Xeon with AVX-512 put one of 42 log-probs 3.6e-6 from its split-call twin. The
# tokens, compared exactly, are the check that the split calls sample what the unsplit call does.
_TOLERANCE = dict(atol=2e-5, rtol=1e-5)


def _assert_same(out, reference):
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  np.testing.assert_array_equal(out.lengths, reference.lengths)
  np.testing.assert_allclose(out.logprobs, reference.logprobs, **_TOLERANCE)
  np.testing.assert_allclose(out.entropies, reference.entropies, **_TOLERANCE)


def test_plan_calls_cuts_the_prompts_into_calls_of_one_shape(two_device_mesh):
  plan = lambda mesh, rows: bounded.plan_calls(_PROMPTS, pad_id=0, vocab_size=64, mesh=mesh, pad_batch_to=1,
                                                        max_rows_per_device=rows)
  calls = plan(None, 3)  # 7 prompts -> calls of 3, 3 and 1 + 2 padding rows
  assert (calls.count, calls.rows, calls.batch) == (3, 3, 7) and calls.ids.shape == (9, 16)
  assert calls.real.tolist() == [True] * 7 + [False] * 2
  np.testing.assert_array_equal(calls.row_keys, np.arange(9))  # a row's key index is its index in the prompts
  ids, mask, real, keys = calls.call(2)
  assert ids.shape == (3, 16) and real.tolist() == [True, False, False] and keys.tolist() == [6, 7, 8]
  assert mask[0].sum() == 9 and mask[1:].sum() == 2  # padding rows hold one visible pad token
  assert (plan(two_device_mesh, 3).count, plan(two_device_mesh, 3).rows) == (2, 6)  # 3 rows x 2 shards a call
  assert (plan(two_device_mesh, 0).count, plan(two_device_mesh, 0).rows) == (1, 8)  # unsplit: 7 padded to 8
  assert (plan(None, 100).count, plan(None, 100).rows) == (1, 7)  # a limit above the batch pads nothing


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("max_rows", [1, 3])
def test_split_calls_give_the_unsplit_samples(model, temperature, max_rows):
  kwargs = dict(max_new_tokens=_NEW, rng=jax.random.key(11), temperature=temperature, eos_ids=_EOS)
  reference = rollout.generate(model, _PROMPTS, **kwargs)
  assert len(set(reference.lengths.tolist())) > 1  # the stop ids end rows at different steps
  _assert_same(rollout.generate(model, _PROMPTS, max_rows_per_device=max_rows, **kwargs), reference)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_split_calls_on_a_two_device_mesh_give_the_unsplit_samples(model, two_device_mesh, temperature):
  kwargs = dict(max_new_tokens=_NEW, rng=jax.random.key(12), temperature=temperature, eos_ids=_EOS)
  reference = rollout.generate(model, _PROMPTS, **kwargs)  # one device, one call
  sharded = _on_mesh(model, two_device_mesh)
  for max_rows in (0, 1, 3):
    _assert_same(rollout.generate(sharded, _PROMPTS, mesh=two_device_mesh, max_rows_per_device=max_rows, **kwargs),
                 reference)


def test_split_calls_compile_once_and_run_at_the_bounded_shape(model, monkeypatch):
  """5 prompts at 2 rows a call: three calls (the last with one prompt), all of shape [2, 16], one trace each."""
  shapes = []
  compiled = sampler._compiled

  def spying(spec):
    prefill, decode, uncached = compiled(spec)
    return (lambda params, ids, *rest: (shapes.append(ids.shape), prefill(params, ids, *rest))[1]), decode, uncached

  monkeypatch.setattr(sampler, "_compiled", spying)
  before = dict(sampler.TRACE_COUNTS)
  kwargs = dict(max_new_tokens=4, rng=jax.random.key(0), temperature=1.0, top_k=7)  # a spec no other test uses
  out = rollout.generate(model, _PROMPTS[:5], max_rows_per_device=2, **kwargs)
  assert shapes == [(2, 16)] * 3 and out.tokens.shape == (5, 4)
  for name in ("prefill", "decode"):
    assert sampler.TRACE_COUNTS[name] - before.get(name, 0) == 1, name


@pytest.mark.parametrize("rows,tokens", [(1, 0), (2, 0), (0, 4), (0, 8), (2, 4), (3, 5)])
def test_chunked_prefill_gives_the_unchunked_samples(model, rows, tokens):
  """Blocks of 1 or 2 rows (3: the last block overlaps), chunks of 4 or 8 slots of the 16-slot bucket (5: the last
  chunk overlaps): the same sampled tokens, float32 log-probs to 1e-6 (`_TOLERANCE`), and the same logits (which
  are all greedy decoding reads)."""
  kwargs = dict(max_new_tokens=_NEW, rng=jax.random.key(13), temperature=1.0, eos_ids=_EOS, return_logits=True)
  prompts = _PROMPTS[:4]  # 4 rows: blocks of 3 overlap
  reference = rollout.generate(model, prompts, **kwargs)
  out = rollout.generate(model, prompts, prefill_rows_per_device=rows, prefill_chunk_tokens=tokens, **kwargs)
  _assert_same(out, reference)
  # Raw logits near 0 carry the rounding of the sums they come from: 1e-5, as tests/test_sampling.py holds the cache.
  np.testing.assert_allclose(out.logits, reference.logits, atol=1e-5, rtol=0)


def test_chunked_prefill_on_a_sharded_mesh(model):
  """Batch over data x fsdp = 2 x 2, KV heads over tensor = 2: blocks take one row of every device."""
  mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  kwargs = dict(max_new_tokens=_NEW, rng=jax.random.key(14), temperature=1.0, eos_ids=_EOS)
  reference = rollout.generate(model, _PROMPTS, **kwargs)
  out = rollout.generate(_on_mesh(model, mesh), _PROMPTS, mesh=mesh, max_rows_per_device=2,
                         prefill_rows_per_device=1, prefill_chunk_tokens=4, **kwargs)
  _assert_same(out, reference)


def test_chunked_prefill_bounds_its_temporary_memory(model):
  """XLA's own accounting of the compiled prefill: blocks of 1 row and chunks of 8 slots need far less scratch
  memory than the whole [8, 64] batch at once (the cache, an output, is the same)."""
  ids = jax.ShapeDtypeStruct((8, 64), jnp.int32)
  rows = jax.ShapeDtypeStruct((8,), jnp.int32)
  controls = (jax.random.key(0), *(jnp.asarray(x) for x in (bounded.stop_array(()), 0, 1.0, 1.0)))
  graphdef, params = nnx.split(model)

  def memory(prefill_rows, prefill_tokens):
    spec = sampler._Spec(graphdef=graphdef, max_new_tokens=8, top_k=0, nucleus=False,
                         return_logits=False, mesh=None, prefill_rows=prefill_rows, prefill_tokens=prefill_tokens)
    prefill = sampler._compiled(spec)[0]
    stats = prefill.lower(params, ids, ids, jax.ShapeDtypeStruct((8,), bool), rows, controls).compile()
    return stats.memory_analysis()

  whole, chunked = memory(0, 0), memory(1, 8)
  assert chunked.output_size_in_bytes == whole.output_size_in_bytes
  assert chunked.temp_size_in_bytes < whole.temp_size_in_bytes / 3, (chunked.temp_size_in_bytes,
                                                                     whole.temp_size_in_bytes)


@pytest.mark.parametrize("name", rollout.MEMORY_LIMITS)
def test_bad_limits_name_the_argument(model, name):
  for value in (-1, 1.5):
    with pytest.raises(ValueError, match=f"{name}={value}"):
      rollout.generate(model, [[1, 2]], max_new_tokens=2, rng=jax.random.key(0), **{name: value})
  config = grpo.get_config("smoke")
  with config.unlocked():
    config.rollout[name] = -2
  with pytest.raises(config_lib.ConfigError, match=f"rollout.{name}=-2"):
    config_lib.validate(config)


@pytest.mark.slow
def test_two_processes_split_their_own_rows(model, tmp_path):
  """Multi-host: process 0 has 5 prompts (6 rows padded), process 1 has 2; at 2 rows a shard both make the same 2
  calls of 4 rows (process 1's second is all padding), prefilled a row of each device at a time. Each gets its rows
  with the samples of one process sampling the unsplit global layout (process 1's rows are global rows 6 and 7)."""
  prompts = [[[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [10], [7, 7], [40, 41, 42, 43]],
             [[20, 21], [30, 31, 32]]]
  got = two_processes.sample_in_two_processes(tmp_path, _CONFIG, prompts, max_new_tokens=5, temperature=1.0,
                                              max_rows_per_device=2, prefill_rows_per_device=1,
                                              prefill_chunk_tokens=8)
  expected = rollout.generate(model, prompts[0] + [[0]] + prompts[1], max_new_tokens=5, rng=jax.random.key(0),
                              temperature=1.0).tokens
  np.testing.assert_array_equal(np.asarray(got[0]), expected[:5])
  np.testing.assert_array_equal(np.asarray(got[1]), expected[6:])


# ----------------------------------------------------------------------------------------------------------------------
# The rollout.* keys reach the sampler: the trainer's rollouts (via SamplerSettings) and the model judge.


def _spy_on_generate(monkeypatch):
  calls = []
  real = rollout.generate

  def spy(model, prompts, **kwargs):
    calls.append({"rows": len(prompts), **{k: kwargs.get(k, 0) for k in rollout.MEMORY_LIMITS}})
    return real(model, prompts, **kwargs)

  monkeypatch.setattr(rollout, "generate", spy)  # the face, which the judge calls
  monkeypatch.setattr(sampler, "generate", spy)  # the module, which the trainer's rollouts call
  return calls


def test_config_keys_reach_the_rollout_sampler(model, monkeypatch):
  config = grpo.get_config("smoke")
  with config.unlocked():
    config.rollout.max_rows_per_device = 2
    config.rollout.prefill_chunk_tokens = 4
  limits = run_setup.sampler_limits(config)
  assert limits == {"max_rows_per_device": 2, "prefill_rows_per_device": 0, "prefill_chunk_tokens": 4}
  settings = rollout.SamplerSettings(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, eos_ids=(5,), pad_id=0,
                                     **limits)
  calls = _spy_on_generate(monkeypatch)
  book = types.SimpleNamespace(prompt_ids=lambda qid: _PROMPTS[qid], answer=lambda qid: "1",
                               tokenizer=types.SimpleNamespace(batch_decode=lambda rows, **_: ["x"] * len(rows)))
  pool = types.SimpleNamespace(score=lambda completions, answers: (np.zeros(len(completions)), {}))
  requests = [replay.Request(qid=0, n_samples=3), replay.Request(qid=2, n_samples=3)]
  groups, info = rollout.sample_groups(lambda delay: model, requests, book, pool, settings, step=0,
                                       rng=jax.random.key(0))
  assert calls == [{"rows": 6, **limits}]
  assert [len(g.rollouts) for g in groups] == [3, 3] and info["rollout/sampled_tokens"] > 0


def test_a_run_resumes_with_other_memory_bounds():
  """They change no sample, so a run that ran out of memory may resume with smaller ones."""
  from jaxrlvr import checkpointing

  saved = grpo.get_config("smoke").to_dict()
  current = grpo.get_config("smoke")
  with current.unlocked():
    for name in rollout.MEMORY_LIMITS:
      current.rollout[name] = 4
    current.rollout.top_k = 3  # not a memory bound: still refused
  assert checkpointing.incompatible_changes(saved, current.to_dict()) == ["rollout.top_k: 0 -> 3"]


def test_config_keys_reach_the_model_judge(monkeypatch):
  calls = _spy_on_generate(monkeypatch)  # before the judge binds rollout.generate
  tokenizer = types.SimpleNamespace(eos_token_id=1, pad_token_id=0, encode=lambda text, **_: types.SimpleNamespace(
      ids=[2 + ord(c) % 60 for c in text[:20]]), decode=lambda ids, **_: "score: 3")
  cfg = types.SimpleNamespace(kind="model", max_new_tokens=3, batch_size=2, get=lambda key, default: default)
  tiny = Transformer(_CONFIG, rngs=nnx.Rngs(1))
  judge = judge_lib.judge_from_config(cfg, model=tiny, tokenizer=tokenizer,
                                      sampler_limits={"max_rows_per_device": 1, "prefill_rows_per_device": 0,
                                                      "prefill_chunk_tokens": 8})
  results = judge.score([judge_lib.JudgeRequest("q", "r", "a")])
  assert calls == [{"rows": 2, "max_rows_per_device": 1, "prefill_rows_per_device": 0, "prefill_chunk_tokens": 8}]
  assert len(results) == 1 and results[0].text == "score: 3"
  with pytest.raises(ValueError, match="prefill_rows_per_device=-1"):
    judge_lib.ModelJudge(tiny, tokenizer, prefill_rows_per_device=-1, generate_fn=rollout.generate)
