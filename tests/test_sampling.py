"""The KV-cache sampler: cache vs recompute, stop tokens, sampling distributions, recompilation, sharding."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

import hf_greedy
import two_processes
from jaxrlvr import rollout
from jaxrlvr import scoring
from jaxrlvr.models import ModelConfig, Transformer
from jaxrlvr.rollout import sampler

# A 2-layer model with a larger init than HF's 0.02, so next-token distributions are peaked and greedy has no ties.
_CONFIG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, initializer_range=0.3)
_PROMPTS = [[3, 14, 15, 9, 2, 6, 5], [35], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6], [43, 38]]  # ragged: 7, 1, 12, 2
_NEW = 6


@pytest.fixture(scope="module")
def model():
  return Transformer(_CONFIG, rngs=nnx.Rngs(0))


def _left_padded(prompts, completions, lengths):
  """[B, bucket + N] ids and mask of prompt + completion, as the sampler laid them out (pad 0)."""
  width = rollout.bucket_length(max(len(p) for p in prompts))
  n = completions.shape[1]
  ids = np.zeros((len(prompts), width + n), np.int32)
  mask = np.zeros_like(ids)
  for row, p in enumerate(prompts):
    ids[row, width - len(p):width] = p
    mask[row, width - len(p):width + lengths[row]] = 1
  ids[:, width:] = completions
  return ids, mask, width


def test_bucket_length():
  # powers of two from 16 to 512, then multiples of 512
  assert [rollout.bucket_length(n) for n in (1, 16, 17, 33, 300, 512, 513, 1025)] == [
      16, 16, 32, 64, 512, 512, 1024, 1536]
  with pytest.raises(ValueError, match="rollout/sampler.py"):
    rollout.bucket_length(0)


def test_cached_decode_equals_recompute_greedy(model):
  """Greedy: the cache gives the logits of recomputing the whole prefix each step (1e-5) and the same tokens."""
  kwargs = dict(max_new_tokens=_NEW, rng=jax.random.key(0), temperature=0.0, return_logits=True)
  cached = rollout.generate(model, _PROMPTS, **kwargs)
  full = rollout.generate(model, _PROMPTS, use_cache=False, **kwargs)
  assert cached.tokens.shape == (4, _NEW) and cached.logits.shape == (4, _NEW, 64)
  np.testing.assert_allclose(cached.logits, full.logits, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(cached.tokens, full.tokens)
  np.testing.assert_array_equal(cached.tokens, np.argmax(cached.logits, -1))
  # Greedy log-probs are the temperature-1 log-softmax of the argmax token (the module's documented choice).
  logp = jax.nn.log_softmax(cached.logits, -1)
  np.testing.assert_allclose(cached.logprobs, np.take_along_axis(logp, cached.tokens[..., None], -1)[..., 0],
                             atol=1e-6)
  # And the logits are those of an independent uncached forward of prompt + completion.
  ids, mask, width = _left_padded(_PROMPTS, cached.tokens, np.full(4, _NEW))
  reference = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))  # [B, T, V]
  np.testing.assert_allclose(cached.logits, reference[:, width - 1:-1], atol=1e-5, rtol=0)


def test_cached_decode_equals_recompute_sampled(model):
  """At temperature 1 the same key draws the same tokens with and without the cache."""
  kwargs = dict(max_new_tokens=_NEW, rng=jax.random.key(7), temperature=1.0)
  cached = rollout.generate(model, _PROMPTS, **kwargs)
  full = rollout.generate(model, _PROMPTS, use_cache=False, **kwargs)
  np.testing.assert_array_equal(cached.tokens, full.tokens)
  np.testing.assert_allclose(cached.logprobs, full.logprobs, atol=1e-5)
  np.testing.assert_allclose(cached.entropies, full.entropies, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_logprobs_equal_score(model, temperature):
  """Replay ratios need the sampler's log-probs to be exactly the teacher-forced ones (1e-5), entropies too."""
  out = rollout.generate(model, _PROMPTS, max_new_tokens=_NEW, rng=jax.random.key(3), temperature=temperature,
                         eos_ids=(5, 11), pad_id=0)
  ids, mask, width = _left_padded(_PROMPTS, out.tokens, out.lengths)
  logp, ent = scoring.score_jit(model, ids, mask, temperature=temperature, chunk_size=4)
  np.testing.assert_allclose(np.asarray(logp)[:, width:], out.logprobs, atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(ent)[:, width:], out.entropies, atol=1e-5, rtol=0)
  active = np.arange(_NEW)[None] < out.lengths[:, None]
  assert np.all(out.logprobs[active] < 0) and np.all(out.logprobs[~active] == 0)


def test_stop_tokens_pad_and_lengths(model):
  """Several stop ids: the row ends at the first one (included), then pad with 0 log-prob and entropy."""
  free = rollout.generate(model, _PROMPTS, max_new_tokens=_NEW, rng=jax.random.key(0), temperature=0.0)
  # Stop ids: the token each of rows 0 and 2 emits at step 2 (so those rows stop after 3 tokens or earlier).
  eos = (int(free.tokens[0, 2]), int(free.tokens[2, 2]))
  out = rollout.generate(model, _PROMPTS, max_new_tokens=_NEW, rng=jax.random.key(0), temperature=0.0,
                         eos_ids=eos, pad_id=63)
  for row in range(len(_PROMPTS)):
    hits = [t for t in range(_NEW) if free.tokens[row, t] in eos]
    expected = hits[0] + 1 if hits else _NEW
    assert out.lengths[row] == expected, (row, free.tokens[row], eos)
    np.testing.assert_array_equal(out.tokens[row, :expected], free.tokens[row, :expected])
    assert np.all(out.tokens[row, expected:] == 63)
    assert np.all(out.logprobs[row, expected:] == 0) and np.all(out.entropies[row, expected:] == 0)
    np.testing.assert_allclose(out.logprobs[row, :expected], free.logprobs[row, :expected], atol=1e-6)
  assert out.lengths[0] <= 3 and out.lengths[2] <= 3


def test_no_recompilation_within_a_bucket(model):
  """Prompts of lengths 5 and 11 both pad to 16: prefill and decode trace once for both batches, also when the
  temperature, top_p value, stop ids and pad id change (they are traced, not static), temperature 0 (greedy, as an
  evaluation samples) included."""
  before = dict(sampler.TRACE_COUNTS)
  kwargs = dict(max_new_tokens=3, top_k=5)  # a spec no other test uses, so the first call must trace
  rollout.generate(model, [[1, 2, 3, 4, 5], [6, 7]], rng=jax.random.key(0), temperature=1.0, top_p=0.9, **kwargs)
  after_first = dict(sampler.TRACE_COUNTS)
  rollout.generate(model, [[9] * 11, [1, 2, 3, 4]], rng=jax.random.key(1), temperature=0.6, top_p=0.5,
                   eos_ids=(3, 4), pad_id=1, **kwargs)
  greedy = rollout.generate(model, [[9] * 11, [1, 2, 3, 4]], rng=jax.random.key(1), temperature=0.0, top_p=0.5,
                            **kwargs)
  after_greedy = dict(sampler.TRACE_COUNTS)
  for name in ("prefill", "decode"):
    assert after_first[name] - before.get(name, 0) == 1, name
    assert after_greedy[name] == after_first[name], name
  # The greedy call took the argmax branch: its first token is a most likely one after each prompt.
  first_logits = model(jnp.asarray([[9] * 11, [0] * 7 + [1, 2, 3, 4]]),
                       attention_mask=jnp.asarray([[1] * 11, [0] * 7 + [1] * 4]))[:, -1]
  np.testing.assert_allclose(greedy.logprobs[:, 0], jax.nn.log_softmax(first_logits).max(axis=-1), atol=1e-5)


def test_invalid_arguments(model):
  with pytest.raises(ValueError, match="empty"):
    rollout.generate(model, [[1], []], max_new_tokens=2, rng=jax.random.key(0))
  with pytest.raises(ValueError, match="top_p"):
    rollout.generate(model, [[1]], max_new_tokens=2, rng=jax.random.key(0), top_p=0.0)
  with pytest.raises(ValueError, match="vocab_size=64"):
    rollout.generate(model, [[1, 64]], max_new_tokens=2, rng=jax.random.key(0))


# ----------------------------------------------------------------------------------------------------------------------
# sample_logits on fixed logits: empirical frequencies against the target distribution.

_LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
_DRAWS = 20000


def _target(temperature, top_k, top_p):
  """The distribution to sample from, written independently of the module: sort, cut, renormalise."""
  z = _LOGITS.astype(np.float64) / temperature
  order = np.argsort(-z)
  keep = np.zeros(len(z), bool)
  keep[order[:top_k if top_k else len(z)]] = True
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  p /= p.sum()
  if top_p < 1.0:
    cumulative, nucleus = 0.0, np.zeros(len(z), bool)
    for i in order:
      if keep[i] and cumulative < top_p:
        nucleus[i] = True
        cumulative += p[i]
    p = np.where(nucleus, p, 0.0)
    p /= p.sum()
  return p


@pytest.mark.parametrize("temperature,top_k,top_p,support", [
    (1.0, 0, 1.0, 8),
    (0.5, 0, 1.0, 8),
    (2.0, 3, 1.0, 3),
    # softmax at T=1: .405 .245 .149 .090 ...; mass before each: 0, .405, .650, .799 -> three tokens below 0.7
    (1.0, 0, 0.7, 3),
    # top-k 5 at T=0.8, renormalised: .486 .260 .139 .075 .040; mass before: 0, .486, .746, .886, .960 -> four < .9
    (0.8, 5, 0.9, 4),
])
def test_sample_logits_matches_target(temperature, top_k, top_p, support):
  keys = jax.random.split(jax.random.key(1234), _DRAWS)
  draw = jax.jit(jax.vmap(lambda k: rollout.sample_logits(jnp.asarray(_LOGITS), k, temperature=temperature,
                                                          top_k=top_k, top_p=top_p)))
  tokens, logprobs, entropies = jax.device_get(draw(keys))
  target = _target(temperature, top_k, top_p)
  assert int(np.sum(target > 0)) == support
  counts = np.bincount(tokens, minlength=len(_LOGITS))
  assert np.all(counts[target == 0] == 0), counts
  kept = target > 0
  if support > 1:
    _, p_value = scipy.stats.chisquare(counts[kept], _DRAWS * target[kept])
    assert p_value > 1e-3, (counts, _DRAWS * target)
  np.testing.assert_allclose(logprobs, np.log(target[tokens]), atol=1e-5)
  entropy = -np.sum(target[kept] * np.log(target[kept]))
  np.testing.assert_allclose(entropies, entropy, atol=1e-5)


def test_sample_logits_greedy():
  tokens, logprobs, entropies = rollout.sample_logits(jnp.asarray(_LOGITS)[None], jax.random.key(0),
                                                      temperature=0.0)
  p = np.exp(_LOGITS - _LOGITS.max())
  p /= p.sum()
  assert int(tokens[0]) == 0
  np.testing.assert_allclose(logprobs[0], np.log(p[0]), atol=1e-6)  # temperature-1 log-prob of the argmax
  np.testing.assert_allclose(entropies[0], -np.sum(p * np.log(p)), atol=1e-6)


def test_inverse_cdf_draws_the_token_whose_interval_holds_u():
  """The two-level draw (blocks of tokens, then a token inside one) against a float64 search over the whole
  cumulative sum, on a vocabulary that is not a whole number of blocks, with runs of zero-probability tokens at the
  start, the end, inside blocks and across whole blocks; u near 0 and 1 included. Never a zero-probability token;
  elsewhere the same token unless u * total lies within float32 rounding of an interval's end."""
  decode = importlib.import_module("jaxrlvr.rollout.decode")  # `rollout.decode` is groups' token decoder
  rng = np.random.default_rng(0)
  vocab = 1000  # 3 blocks of 256 and a partial one
  probs = rng.exponential(size=(6, vocab)).astype(np.float32)
  probs[:, :20] = 0  # zero runs: at the start,
  probs[:, 250:530] = 0  # across a whole block,
  probs[:, 700:705] = 0  # inside one,
  probs[:, 990:] = 0  # and at the end
  probs[1] = 0
  probs[1, [5, 600]] = [0.25, 0.75]  # a row with two tokens
  probs /= probs.sum(-1, keepdims=True)
  u = np.concatenate([[0.0, 1e-9, 0.5, 1 - 1e-7, np.nextafter(np.float32(1), np.float32(0))],
                      rng.uniform(size=395)]).astype(np.float32)  # [U]
  draw = jax.vmap(decode._inverse_cdf, in_axes=(None, 0))  # pylint: disable=protected-access
  tokens = np.asarray(jax.jit(draw)(probs, u))  # [U, rows]
  cdf = np.cumsum(probs.astype(np.float64), axis=-1)  # [rows, V]
  for row in range(probs.shape[0]):
    assert np.all(probs[row, tokens[:, row]] > 0), row
    want = np.minimum(np.searchsorted(cdf[row], u * cdf[row, -1], side="right"), np.flatnonzero(probs[row])[-1])
    near = np.min(np.abs(cdf[row][None, :] - (u * cdf[row, -1])[:, None]), axis=-1) < 1e-6
    assert np.all((tokens[:, row] == want) | near), (row, np.flatnonzero((tokens[:, row] != want) & ~near))
    assert np.sum(near) < 10
  assert set(tokens[:, 1]) == {5, 600}


# ----------------------------------------------------------------------------------------------------------------------
# Sharded on the 8 fake devices, and parity with transformers.


def test_sharded_generate_equals_single_device(model):
  """Batch over (data, fsdp) = 4 shards (5 prompts padded to 8), heads over tensor = 2: same tokens as one device."""
  from jaxrlvr import parallel

  mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  graphdef, state = nnx.split(model)
  sharded = nnx.merge(graphdef, jax.device_put(state, parallel.param_shardings(state, mesh)))
  prompts = _PROMPTS + [[60, 61, 62]]
  kwargs = dict(max_new_tokens=_NEW, rng=jax.random.key(5), temperature=0.0)
  single = rollout.generate(model, prompts, **kwargs)
  multi = rollout.generate(sharded, prompts, mesh=mesh, **kwargs)
  np.testing.assert_array_equal(multi.tokens, single.tokens)
  np.testing.assert_allclose(multi.logprobs, single.logprobs, atol=1e-5)
  np.testing.assert_allclose(multi.entropies, single.entropies, atol=1e-5)
  np.testing.assert_array_equal(multi.lengths, single.lengths)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_greedy_equals_transformers(kind, tmp_path):
  """Ragged, left-padded greedy decoding gives transformers' greedy `generate` tokens, stop id included."""
  from jaxrlvr.models import load_pretrained

  hf = hf_greedy.tiny_model(kind)
  hf.save_pretrained(tmp_path)
  ours, _ = load_pretrained(str(tmp_path))
  prompts = [[5, 17, 33, 2, 90], [41], [7, 7, 8, 60, 12, 3, 71, 1, 44]]
  new = 8
  expected = hf_greedy.greedy(hf, prompts, new)
  out = rollout.generate(ours, prompts, max_new_tokens=new, rng=jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(out.tokens, expected)
  # With a stop id (the token row 0 emits at step 3), transformers pads after it just as we do.
  eos = int(expected[0, 3])
  stopped = hf_greedy.greedy(hf, prompts, new, eos=eos)
  out = rollout.generate(ours, prompts, max_new_tokens=new, rng=jax.random.key(0), temperature=0.0, eos_ids=(eos,))
  assert out.lengths[0] <= 4
  np.testing.assert_array_equal(out.tokens[:, :stopped.shape[1]], stopped)
  assert np.all(out.tokens[:, stopped.shape[1]:] == 0)


@pytest.mark.slow
def test_two_processes_each_get_their_own_rows(model, tmp_path):
  """Multi-host: 2 CPU processes with different prompt counts and lengths; each gets back its own rows.

  Process 0 pads its 3 prompts to 4 rows (2 batch shards each), so process 1's prompts are global rows 4 and 5; a
  single process sampling the same global layout (same key, row keys by global row) gives the same tokens."""
  prompts = [[[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [10]], [[20, 21], [30, 31, 32]]]
  got = two_processes.sample_in_two_processes(tmp_path, _CONFIG, prompts, max_new_tokens=5, temperature=1.0)
  expected = rollout.generate(model, prompts[0] + [[0]] + prompts[1], max_new_tokens=5, rng=jax.random.key(0),
                              temperature=1.0).tokens
  np.testing.assert_array_equal(np.asarray(got[0]), expected[:3])
  np.testing.assert_array_equal(np.asarray(got[1]), expected[4:])
