"""Completions packed into fewer rows (packing.py, scoring.score_packed_completions): the host's plan, and the same
log-probs, entropies and gradients as the unpacked update."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import packing
from jaxrlvr import scoring
from jaxrlvr import step as step_lib
from jaxrlvr.models import ModelConfig, Transformer

_CONFIG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, initializer_range=0.3)
PROMPT_LEN, WIDTH, GROUP = 6, 8, 4


def _grouped_batch(seed: int = 1, groups: int = 3, filler_groups: int = 1):
  """`groups` groups of GROUP rows (a left-padded prompt each, answers of 1..WIDTH tokens), then filler groups (one
  visible prompt token, no answer), as the loop's batches come."""
  rs = np.random.RandomState(seed)
  rows = (groups + filler_groups) * GROUP
  ids = np.zeros((rows, PROMPT_LEN + WIDTH), np.int32)
  mask = np.zeros_like(ids)
  for g in range(groups):
    prompt = rs.randint(1, 64, size=rs.randint(2, PROMPT_LEN + 1))
    for r in range(g * GROUP, (g + 1) * GROUP):
      answer = rs.randint(1, 64, size=rs.randint(1, WIDTH + 1))
      ids[r, PROMPT_LEN - len(prompt):PROMPT_LEN] = prompt
      ids[r, PROMPT_LEN:PROMPT_LEN + len(answer)] = answer
      mask[r, PROMPT_LEN - len(prompt):PROMPT_LEN + len(answer)] = 1
  mask[groups * GROUP:, PROMPT_LEN - 1] = 1
  return ids, mask


def _fewest_rows(ids, mask, max_prompts):
  for rows in range(1, ids.shape[0] + 1):
    plan = packing.plan_micro_batch(ids, mask, prompt_len=PROMPT_LEN, group_size=GROUP, packed_rows=rows,
                                    max_prompts=max_prompts)
    if plan is not None:
      return rows, plan
  raise AssertionError("no plan")


@pytest.mark.parametrize("max_prompts", [1, 2, 3])
def test_plan_puts_every_answer_token_once_and_no_row_past_its_prompts(max_prompts):
  ids, mask = _grouped_batch()
  rows, plan = _fewest_rows(ids, mask, max_prompts)
  lengths = mask[:, PROMPT_LEN:].sum(1)
  assert rows < ids.shape[0] and rows >= -(-lengths.sum() // WIDTH)
  p, unpack = plan["packing"], plan["unpack"]
  flat_ids = np.append(p["ids"].reshape(-1), 0)
  np.testing.assert_array_equal(flat_ids[unpack], np.where(mask[:, PROMPT_LEN:] > 0, ids[:, PROMPT_LEN:], 0))
  real = unpack[mask[:, PROMPT_LEN:] > 0]
  assert len(set(real.tolist())) == lengths.sum() == (p["segments"] > 0).sum()  # each token once, nothing else
  for r in range(rows):
    used = set(p["blocks"][r][p["segments"][r] > 0].tolist())
    assert used <= set(range(max_prompts))
  # positions continue from each answer's prompt length; each answer's first token is marked
  flat_pos = np.append(p["positions"].reshape(-1), -1)[unpack]
  prompt_lengths = mask[:, :PROMPT_LEN].sum(1)
  for r in np.flatnonzero(lengths):
    np.testing.assert_array_equal(flat_pos[r, :lengths[r]], prompt_lengths[r] + np.arange(lengths[r]))
    assert np.append(p["starts"].reshape(-1), False)[unpack[r, 0]]
  assert p["starts"].sum() == np.count_nonzero(lengths)
  assert packing.plan_micro_batch(ids, mask, prompt_len=PROMPT_LEN, group_size=GROUP, packed_rows=rows - 1,
                                  max_prompts=max_prompts) is None


def test_micro_batch_rows_are_the_update_split():
  for minibatches, micro in ((1, 1), (2, 1), (1, 2), (2, 2)):
    rows = np.arange(GROUP * 8)
    want = np.asarray(step_lib._split_rows(jnp.asarray(rows), minibatches, micro, GROUP))
    np.testing.assert_array_equal(packing.micro_batch_rows(len(rows), minibatches, micro, GROUP), want)


@pytest.mark.parametrize("max_prompts", [1, 2])
def test_packed_scores_and_gradients_equal_the_unpacked(max_prompts):
  """Log-probs, entropies and the gradient of a loss over both: packed (the fewest rows the plan fits) against
  `score_shared_prompts` on the same rows, float32 rounding apart."""
  model = Transformer(_CONFIG, rngs=nnx.Rngs(1))
  graphdef, params = nnx.split(model)
  ids, mask = _grouped_batch()
  _, plan = _fewest_rows(ids, mask, max_prompts)
  weights = jax.random.normal(jax.random.key(0), (ids.shape[0], WIDTH))

  def loss(p, packed):
    m = nnx.merge(graphdef, p)
    if packed:
      logp, ent = scoring.score_packed_completions(m, jnp.asarray(ids), jnp.asarray(mask), plan["packing"],
                                                   plan["unpack"], group_size=GROUP, prompt_len=PROMPT_LEN,
                                                   chunk_size=3, vocab_chunk_size=24)
    else:
      logp, ent = scoring.score_shared_prompts(m, jnp.asarray(ids), jnp.asarray(mask), group_size=GROUP,
                                               prompt_len=PROMPT_LEN, chunk_size=3, vocab_chunk_size=24)
    return jnp.sum(weights * logp) + 0.1 * jnp.sum(ent), (logp, ent)

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, (logp, ent)), grads = grad(params, True)
  (_, (ref_logp, ref_ent)), ref_grads = grad(params, False)
  assert np.any(np.asarray(ref_logp) != 0)
  np.testing.assert_allclose(logp, ref_logp, atol=2e-5, rtol=0)
  np.testing.assert_allclose(ent, ref_ent, atol=2e-5, rtol=0)
  # Gradients reach ~15 here and are summed over the rows in float32 in a different order packed and unpacked (and
  # by CPU: 3.1e-5 apart on an Intel Xeon with AVX-512); a segment attending across its boundary moves them by far
  # more.
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
