"""The rollout engine: the static sampler's and transformers' tokens, a row's samples whatever the slots or the order,
teacher-forced log-probs, the sampling distribution, no recompilation, and the segmented cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

import hf_greedy
from jaxrlvr import rollout
from jaxrlvr import scoring
from jaxrlvr.models import ModelConfig, Transformer
from jaxrlvr.rollout import engine
from jaxrlvr.rollout import scheduler

# test_sampling.py's model: a larger init than HF's 0.02, so next-token distributions are peaked and greedy has no ties.
_CONFIG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, initializer_range=0.3)
_PROMPTS = [[3, 14, 15, 9, 2, 6, 5], [35], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6], [43, 38]]  # ragged: 7, 1, 12, 2
_NEW = 40  # with the 16-slot bucket, 56 cache slots: segments of 8, 8, 16, 16, 8 under `small_segments`


@pytest.fixture(scope="module")
def model():
  return Transformer(_CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture
def small_segments(monkeypatch):
  """Cache segments of 8, 8, 16, 16 ... slots, so that short answers cross several of them (and their conds)."""
  monkeypatch.setattr(engine, "FIRST_SEGMENT", 8)
  monkeypatch.setattr(engine, "MAX_SEGMENT", 16)


def _group_prompts(groups: int = 6, samples: int = 4, seed: int = 1) -> list[list[int]]:
  """GRPO-like rows: `groups` prompts of ragged lengths (< 16), `samples` copies each, consecutive."""
  rs = np.random.RandomState(seed)
  prompts = [rs.randint(1, 64, size=n).tolist() for n in rs.randint(1, 14, size=groups)]
  return [p for p in prompts for _ in range(samples)]


def test_segment_bounds_cover_the_capacity():
  assert engine.segment_bounds(544) == ((0, 64), (64, 64), (128, 128), (256, 288))  # a 32-slot tail joins
  assert engine.segment_bounds(80) == ((0, 80),)
  assert engine.segment_bounds(600) == ((0, 64), (64, 64), (128, 128), (256, 256), (512, 88))
  assert engine.segment_bounds(2000) == ((0, 64), (64, 64), (128, 128), (256, 256), (512, 512), (1024, 512),
                                         (1536, 464))
  assert engine.segment_bounds(40) == ((0, 40),)


def test_compaction_sizes_are_bounded_by_the_chunk_boundaries(model):
  """Steps of 3/4 and 2/3; with fewer chunk boundaries than those sizes, halvings, as many as the boundaries. A call
  of 26 tokens in 16-step chunks (the embedded default's) compiles two decode shapes, not eleven."""
  assert scheduler.compaction_sizes(64, 2) == [48, 32, 24, 16, 12, 8]
  assert scheduler.compaction_sizes(64, 2, max_levels=6) == [48, 32, 24, 16, 12, 8]
  assert scheduler.compaction_sizes(128, 1, max_levels=3) == [64, 32, 16]
  assert scheduler.compaction_sizes(128, 1, max_levels=1) == [64]
  assert scheduler.compaction_sizes(128, 1, max_levels=0) == []
  before = engine.TRACE_COUNTS["decode"]
  scheduler.generate(model, _group_prompts(groups=16, samples=8), max_new_tokens=26, rng=0, eos_ids=(5, 11),
                            chunk_steps=16)
  assert engine.TRACE_COUNTS["decode"] - before == 2  # 128 slots, then 64


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_equals_the_static_sampler(model, small_segments, temperature):
  """Same tokens and lengths as `rollout.generate` (stop ids, pad after the stop), log-probs and entropies to 2e-5;
  also through `rollout.generate(engine='continuous')`."""
  kwargs = dict(max_new_tokens=_NEW, rng=jax.random.key(3), temperature=temperature, eos_ids=(5, 11), pad_id=63)
  static = rollout.generate(model, _PROMPTS, **kwargs)
  ours = scheduler.generate(model, _PROMPTS, **kwargs)
  assert 1 < static.lengths.min() < _NEW  # rows stop at different steps
  np.testing.assert_array_equal(ours.lengths, static.lengths)
  np.testing.assert_array_equal(ours.tokens, static.tokens)
  # Two float32 computations of the same numbers (each within ~1e-5 of teacher-forced scoring): 2e-5 apart at most.
  np.testing.assert_allclose(ours.logprobs, static.logprobs, atol=2e-5, rtol=0)
  np.testing.assert_allclose(ours.entropies, static.entropies, atol=2e-5, rtol=0)
  through = rollout.generate(model, _PROMPTS, engine="continuous", decode_slots=1, **kwargs)
  np.testing.assert_array_equal(through.tokens, static.tokens)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_teacher_forced_scoring(model, small_segments, temperature):
  prompts = _group_prompts()
  out = scheduler.generate(model, prompts, max_new_tokens=_NEW, rng=jax.random.key(4), temperature=temperature,
                                  eos_ids=(5, 11), decode_slots=8, chunk_steps=4)
  width = rollout.bucket_length(max(map(len, prompts)))
  ids = np.zeros((len(prompts), width + _NEW), np.int32)
  mask = np.zeros_like(ids)
  for row, p in enumerate(prompts):
    ids[row, width - len(p):width] = p
    mask[row, width - len(p):width + out.lengths[row]] = 1
  ids[:, width:] = out.tokens
  logp, ent = scoring.score_jit(model, ids, mask, temperature=temperature, chunk_size=8)
  # 1e-5, relative to the log-prob's size as well: this model's peaked logits over 0.7 reach float32 rounding of
  # 1e-5 (the static sampler's log-probs of these rows are 1.05e-5 from scoring's at 0.7, the engine's 1.00e-5).
  np.testing.assert_allclose(np.asarray(logp)[:, width:], out.logprobs, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(ent)[:, width:], out.entropies, atol=1e-5, rtol=1e-5)
  active = np.arange(_NEW)[None] < out.lengths[:, None]
  assert np.all(out.logprobs[active] < 0) and np.all(out.logprobs[~active] == 0)


def test_a_rows_samples_do_not_depend_on_slots_or_order(model, small_segments):
  """24 rows on 2, 8 and 64 slots per device (64: one per row, then compaction), and in a shuffled order with each
  row's key going with it: every row samples the same tokens; rows queue, enter freed slots and leave."""
  prompts = _group_prompts()
  kwargs = dict(max_new_tokens=_NEW, rng=jax.random.key(7), temperature=1.0, eos_ids=(5, 11, 17))
  runs = {}
  for slots in (2, 8, 64):
    stats = {}
    runs[slots] = scheduler.generate(model, prompts, decode_slots=slots, chunk_steps=4, stats=stats, **kwargs)
    assert stats["useful_row_steps"] == runs[slots].lengths.sum() <= stats["row_steps"]
    if slots < len(prompts):
      assert stats["inserts"] > 1  # queued rows entered freed slots
    else:
      # No queue: each chunk is dispatched before the last one's report is read, and the compactions come while a
      # chunk is in flight (their rows still sample what the other slot counts sample, below).
      assert stats["compactions"] >= 1 and stats["chunks_ahead"] >= stats["compactions"]
  lengths = runs[64].lengths
  assert len(set(lengths.tolist())) > 3  # a spread of lengths, so entry times differ
  order = np.random.RandomState(0).permutation(len(prompts))
  shuffled = scheduler.generate(model, [prompts[i] for i in order], row_keys=order, decode_slots=8,
                                       chunk_steps=3, **kwargs)
  back = np.argsort(order)  # shuffled row back[i] is row i
  runs["shuffled"] = rollout.SampleOutput(tokens=shuffled.tokens[back], logprobs=shuffled.logprobs[back],
                                          entropies=shuffled.entropies[back], lengths=shuffled.lengths[back])
  for name, out in runs.items():
    np.testing.assert_array_equal(out.tokens, runs[64].tokens, err_msg=str(name))
    np.testing.assert_array_equal(out.lengths, lengths, err_msg=str(name))
    np.testing.assert_allclose(out.logprobs, runs[64].logprobs, atol=1e-5, rtol=0, err_msg=str(name))


def test_rows_are_handed_over_as_they_finish(model, small_segments):
  """on_rows_done sees every row once, with its final tokens and length, in pieces as chunks end (so that rewards
  can be scored while the device decodes the next chunk)."""
  prompts = _group_prompts()
  seen = []
  stats = {}

  def on_rows_done(rows, tokens, lengths):
    seen.append((rows, tokens, lengths))

  out = scheduler.generate(model, prompts, max_new_tokens=_NEW, rng=jax.random.key(7), temperature=1.0,
                                  eos_ids=(5, 11, 17), decode_slots=8, chunk_steps=4, stats=stats,
                                  on_rows_done=on_rows_done)
  rows = np.concatenate([r for r, _, _ in seen])
  assert sorted(rows.tolist()) == list(range(len(prompts)))
  for r, tokens, lengths in seen:
    np.testing.assert_array_equal(tokens, out.tokens[r])
    np.testing.assert_array_equal(lengths, out.lengths[r])
  assert 2 < len(seen) <= stats["chunks"]
  seen.clear()  # the static sampler hands every row over at the end
  static = rollout.generate(model, prompts, max_new_tokens=8, rng=jax.random.key(7), on_rows_done=on_rows_done)
  assert len(seen) == 1 and seen[0][0].tolist() == list(range(len(prompts)))
  np.testing.assert_array_equal(seen[0][1], static.tokens)


def test_chunked_and_distinct_prefill_give_the_same_samples(model, small_segments):
  """The prefill in chunks of 5 slots, or at most 2 distinct prompts at a time: the same rows."""
  prompts = _group_prompts()
  kwargs = dict(max_new_tokens=12, rng=jax.random.key(2), temperature=1.0, decode_slots=8)
  base = scheduler.generate(model, prompts, **kwargs)
  for extra in (dict(prefill_chunk_tokens=5), dict(prefill_rows_per_device=2)):
    out = scheduler.generate(model, prompts, **kwargs, **extra)
    np.testing.assert_array_equal(out.tokens, base.tokens, err_msg=str(extra))


def _target(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """The distribution to sample from, written independently of the package: scale, cut, renormalise."""
  z = logits.astype(np.float64) / temperature
  order = np.argsort(-z)
  keep = np.zeros(len(z), bool)
  keep[order[:top_k or len(z)]] = True
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  p /= p.sum()
  if top_p < 1.0:
    mass, nucleus = 0.0, np.zeros(len(z), bool)
    for i in order:
      if keep[i] and mass < top_p:
        nucleus[i] = True
        mass += p[i]
    p = np.where(nucleus, p, 0.0) / np.sum(np.where(nucleus, p, 0.0))
  return p


def _chi_square_p(counts: np.ndarray, target: np.ndarray) -> float:
  """Chi-square p-value of `counts` against `target`, bins expecting fewer than 5 merged into one."""
  assert np.all(counts[target == 0] == 0), (counts, target)
  expected = counts.sum() * target
  big = expected >= 5
  observed = np.append(counts[big], counts[~big].sum())
  expected = np.append(expected[big], expected[~big].sum())
  if expected[-1] == 0:
    observed, expected = observed[:-1], expected[:-1]
  return scipy.stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (0.8, 0, 0.9)])
def test_engine_samples_the_target_distribution(model, temperature, top_k, top_p):
  """4,096 rows of one prompt (prefilled once): the first token (sampled at insert) and the second token after the
  most frequent first one (sampled by the decode step) follow the model's filtered distribution."""
  prompt = [3, 14, 15, 9, 2]
  rows = 4096
  out = scheduler.generate(model, [prompt] * rows, max_new_tokens=2, rng=jax.random.key(11),
                                  temperature=temperature, top_k=top_k, top_p=top_p)
  first_logits = np.asarray(model(jnp.asarray([prompt])))[0, -1]
  first = out.tokens[:, 0]
  assert _chi_square_p(np.bincount(first, minlength=64), _target(first_logits, temperature, top_k, top_p)) > 1e-3
  common = int(np.bincount(first).argmax())
  second = out.tokens[first == common, 1]
  assert len(second) > 500
  second_logits = np.asarray(model(jnp.asarray([prompt + [common]])))[0, -1]
  target = _target(second_logits, temperature, top_k, top_p)
  assert _chi_square_p(np.bincount(second, minlength=64), target) > 1e-3
  # The log-probs are those of the distribution sampled from.
  np.testing.assert_allclose(out.logprobs[first == common, 1], np.log(target[second]), atol=1e-5)


def test_no_recompilation_across_calls(model, small_segments):
  """Calls as an RL run's steps make them (other questions of other lengths in the same bucket, K samples each,
  another temperature, top_p value, stop ids and pad id) trace nothing after the first: no engine shape depends on
  a step, on where rows stop, or on when they enter."""
  kwargs = dict(max_new_tokens=_NEW, top_k=7, decode_slots=4, chunk_steps=5)  # a spec no other test uses
  prompts = _group_prompts()
  scheduler.generate(model, prompts, rng=jax.random.key(0), temperature=1.0, top_p=0.9, eos_ids=(5,), **kwargs)
  before = dict(engine.TRACE_COUNTS)
  scheduler.generate(model, prompts[::-1], rng=jax.random.key(1), temperature=0.6, top_p=0.5, eos_ids=(3, 4),
                            pad_id=1, **kwargs)
  scheduler.generate(model, _group_prompts(seed=2), rng=jax.random.key(2), temperature=1.0, top_p=0.95,
                            eos_ids=(9,), **kwargs)
  # Greedy (an evaluation's temperature 0) runs the same compiled programs, and its tokens are the static sampler's.
  greedy = scheduler.generate(model, prompts, rng=jax.random.key(3), temperature=0.0, top_p=0.95, **kwargs)
  assert dict(engine.TRACE_COUNTS) == before
  static = rollout.generate(model, prompts, max_new_tokens=_NEW, rng=jax.random.key(4), temperature=0.0)
  np.testing.assert_array_equal(greedy.tokens, static.tokens)


def test_sharded_engine_equals_single_device(model, small_segments):
  """Slots over (data, fsdp) = 4 shards with kv heads over tensor = 2, and the training mesh fsdp = 8: the
  single-device tokens, with the weights in the decode layout or as trained."""
  from jaxrlvr import parallel

  prompts = _group_prompts()
  kwargs = dict(max_new_tokens=_NEW, rng=jax.random.key(5), temperature=1.0, eos_ids=(5, 11), decode_slots=2,
                chunk_steps=4)
  single = scheduler.generate(model, prompts, **kwargs)
  graphdef, params = nnx.split(model)
  fsdp = parallel.make_mesh(data=1, fsdp=8)
  cases = [(parallel.make_mesh(data=2, fsdp=2, tensor=2), "replicated"), (fsdp, "replicated"), (fsdp, "training")]
  for mesh, weights in cases:
    sharded = nnx.merge(graphdef, jax.device_put(params, parallel.param_shardings(params, mesh)))
    multi = scheduler.generate(sharded, prompts, mesh=mesh, decode_weights=weights, **kwargs)
    np.testing.assert_array_equal(multi.tokens, single.tokens, err_msg=f"{mesh.shape} {weights}")
    # The tokens are the check; log-probs in float32 differ by XLA:CPU's reduction order over the shards and by CPU
    # (1.2e-5 on an Intel Xeon with AVX-512, under 1e-5 on an AMD EPYC).
    np.testing.assert_allclose(multi.logprobs, single.logprobs, atol=5e-5)


def _collectives(mesh, params, graphdef) -> set:
  """The collective ops in the compiled decode chunk of 16 slots on `mesh`."""
  from jaxrlvr import parallel

  spec = engine.EngineSpec(graphdef=graphdef, max_new_tokens=_NEW, capacity=56, top_k=0, nucleus=False,
                           chunk_steps=4, mesh=mesh, segment_sizes=(8, 16))
  fns = engine.compiled(spec)
  replicated = lambda x: jax.device_put(x, parallel.replicated(mesh))
  controls = engine.Controls(rng=replicated(jax.random.key(0)), stop_ids=replicated(np.full(4, -1, np.int32)),
                             temperature=replicated(np.float32(1)),
                             top_p=replicated(np.float32(1)))
  state = fns.init(params, 16, controls)
  text = fns.decode_chunk.lower(params, state, np.int32(17)).compile().as_text()
  ops = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
  return {op for op in ops if f" {op}(" in text}


def test_the_decode_loop_gathers_no_weight_on_an_fsdp_mesh(model):
  """The training mesh fsdp = 8 splits every weight over the 8 devices: decoding from that layout all-gathers
  weights inside the loop; from `engine.decode_layout` the compiled loop holds no all-gather at all (only the
  all-reduces of which slots are live), and neither does it on a data-parallel mesh (no cache moves)."""
  from jaxrlvr import parallel

  graphdef, params = nnx.split(model)
  mesh = parallel.make_mesh(data=1, fsdp=8)
  trained = jax.device_put(params, parallel.param_shardings(params, mesh))
  assert "fsdp" in str(jax.tree.leaves(trained)[0].sharding.spec)
  assert "all-gather" in _collectives(mesh, trained, graphdef)  # the control: the test can fail
  decode = engine.decode_layout(trained, mesh, "float32")
  assert _collectives(mesh, decode, graphdef) == {"all-reduce"}
  data = parallel.make_mesh(data=8)
  replicated = jax.device_put(params, parallel.param_shardings(params, data))
  assert _collectives(data, replicated, graphdef) == {"all-reduce"}
  # Weights already as the decode reads them are not copied; a cast to another compute dtype is.
  assert engine.decode_layout(replicated, data, "float32") is replicated
  cast = engine.decode_layout(replicated, data, "bfloat16")
  assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(engine.decode_layout(cast, data, "float32"))} == {jnp.dtype(jnp.float32)}


def test_greedy_equals_transformers(tmp_path):
  """Ragged, left-padded greedy decoding by transformers gives the engine's tokens (test_sampling.py's model, on more
  decode steps than the first cache segment holds)."""
  from jaxrlvr.models import load_pretrained

  hf = hf_greedy.tiny_model("qwen2", max_positions=256)
  hf.save_pretrained(tmp_path)
  ours, _ = load_pretrained(str(tmp_path))
  prompts = [[5, 17, 33, 2, 90], [41], [7, 7, 8, 60, 12, 3, 71, 1, 44]]
  new = 80  # 16 + 80 cache slots: two segments
  out = scheduler.generate(ours, prompts, max_new_tokens=new, rng=jax.random.key(0), temperature=0.0,
                                  decode_slots=1)
  np.testing.assert_array_equal(out.tokens, hf_greedy.greedy(hf, prompts, new))


def test_invalid_arguments_name_themselves(model):
  with pytest.raises(ValueError, match="decode_slots=-1"):
    scheduler.generate(model, [[1]], max_new_tokens=2, rng=0, decode_slots=-1)
  with pytest.raises(ValueError, match="decode_chunk_steps=0"):
    scheduler.generate(model, [[1]], max_new_tokens=2, rng=0, chunk_steps=0)
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    scheduler.generate(model, [[1], []], max_new_tokens=2, rng=0)
  with pytest.raises(ValueError, match="row_keys has 1 entries for 2 prompts"):
    scheduler.generate(model, [[1], [2]], max_new_tokens=2, rng=0, row_keys=[0])
  with pytest.raises(ValueError, match="engine='static' for use_cache=False"):
    rollout.generate(model, [[1]], max_new_tokens=2, rng=0, engine="continuous", return_logits=True)
  with pytest.raises(ValueError, match="engine='paged'"):
    rollout.generate(model, [[1]], max_new_tokens=2, rng=0, engine="paged")


def test_prepare_compiles_what_generate_runs_and_samples_nothing(model):
  """`rollout.prepare` (what the trainer runs beside the step-0 evaluation) traces and compiles the programs a call
  runs without sampling; the call itself then traces nothing. The static sampler has nothing to prepare."""
  prompts = _group_prompts(groups=3, samples=4, seed=5)
  kwargs = dict(max_new_tokens=37, temperature=1.0, eos_ids=(5, 11))  # a length no other test samples: fresh shapes
  traced = lambda: sum(engine.TRACE_COUNTS.values())
  before = traced()
  assert not rollout.prepare(model, prompts, rng=jax.random.key(3), engine="static", **kwargs)
  assert traced() == before
  assert rollout.prepare(model, prompts, rng=jax.random.key(3), engine="continuous", **kwargs)
  prepared = traced()
  assert prepared > before  # the insert, the decode chunks of every compaction level, the compactions
  out = rollout.generate(model, prompts, rng=jax.random.key(3), engine="continuous", **kwargs)
  assert traced() == prepared
  assert out.tokens.shape == (len(prompts), 37) and (out.lengths > 0).all()
