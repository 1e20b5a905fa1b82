"""Teacher-forced per-token log-probs and entropies, without ever holding full [B, T, V] float32 logits.

The trainer calls `score` inside its loss (old log-probs, the policy ratio, the entropy bonus) and ExGRPO calls it to
pick the lowest-entropy stored answer. With a 152k vocabulary and 8k tokens, full fp32 logits would be ~5 GB per
sequence, so the final projection is done in chunks: a `lax.map` over sequence chunks of `chunk_size` positions, each
rematerialised (`jax.checkpoint`) so the backward pass recomputes its logits instead of storing them, and inside each
a `lax.scan` over vocabulary chunks with an online log-sum-exp. Peak logits memory is [B, chunk_size,
vocab_chunk_size] (forward and backward).

Definitions (match `jaxrlvr.rollout.generate` at temperature T with no top-k / top-p):
  logprobs[:, t] = log softmax(logits_{t-1} / T)[input_ids[:, t]],  entropies[:, t] = entropy of that distribution,
  where logits_{t-1} are the model's logits after input_ids[:, :t]. Position 0 has no prediction and gets 0, and so
  does every position whose `attention_mask` is 0 (padding), so sums over a row need no further masking.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

DEFAULT_CHUNK_SIZE = 128
DEFAULT_VOCAB_CHUNK_SIZE = 32768


def score(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
          vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE, temperature: float = 1.0,
          positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Teacher-forced (logprobs [B, T], entropies [B, T]) float32 of `input_ids` [B, T] under `model`.

  Pure and differentiable w.r.t. the model's parameters; call it inside your own jit (see `score_jit` for a jitted
  wrapper). `attention_mask` [B, T] marks real tokens (left padding before the prompt, right padding after the
  answer); RoPE positions default to the model's cumsum(mask) - 1, which is what the sampler uses.

  Under a mesh the batch stays sharded over ('data', 'fsdp') through the chunks. When the vocabulary is sharded
  over 'tensor', slicing it into chunks makes XLA gather the unembedding; there each device already holds only
  V / tensor columns, so pass vocab_chunk_size >= vocab_size (one chunk, no slicing) unless memory says otherwise.
  """
  if temperature <= 0:
    raise ValueError(f"scoring.py: temperature={temperature} must be > 0 (score greedy rollouts at temperature 1)")
  if chunk_size < 1 or vocab_chunk_size < 1:
    raise ValueError(f"scoring.py: chunk_size={chunk_size} and vocab_chunk_size={vocab_chunk_size} must be >= 1")
  if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
    raise ValueError(f"scoring.py: input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must be the "
                     "same [B, T] shape")
  hidden, _ = model.hidden(input_ids, positions=positions, attention_mask=attention_mask)  # [B, T, D]
  unembedding = model.unembedding()  # [D, V]
  # Position t predicts token t + 1: score hidden[:, t] against input_ids[:, t + 1], then shift right by one.
  targets = jnp.concatenate([input_ids[:, 1:], jnp.zeros_like(input_ids[:, :1])], axis=1)  # [B, T]
  logp, ent = chunked_logprobs(hidden, unembedding, targets, chunk_size=chunk_size,
                               vocab_chunk_size=vocab_chunk_size, temperature=temperature)
  batch = input_ids.shape[0]
  zero = jnp.zeros((batch, 1), jnp.float32)
  keep = attention_mask.astype(bool)
  logp = jnp.where(keep, jnp.concatenate([zero, logp[:, :-1]], axis=1), 0.0)
  ent = jnp.where(keep, jnp.concatenate([zero, ent[:, :-1]], axis=1), 0.0)
  return logp, ent


def chunked_logprobs(hidden: jax.Array, unembedding: jax.Array, targets: jax.Array, *, chunk_size: int,
                     vocab_chunk_size: int, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """log softmax(hidden @ unembedding / T)[targets] and the entropy, per position: [B, T] each, float32.

  hidden [B, T, D], unembedding [D, V], targets [B, T] int. Sequence chunks of `chunk_size` (T is padded up to a
  multiple), vocabulary chunks of about `vocab_chunk_size` (see `_vocab_chunks`).
  """
  batch, length, width = hidden.shape
  chunk = min(chunk_size, length)
  num_chunks = -(-length // chunk)
  pad = num_chunks * chunk - length
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  hidden = hidden.reshape(batch, num_chunks, chunk, width).swapaxes(0, 1)  # [n, B, C, D]
  targets = targets.reshape(batch, num_chunks, chunk).swapaxes(0, 1)  # [n, B, C]
  per_chunk = jax.checkpoint(functools.partial(_chunk_logprobs, unembedding=unembedding,
                                               vocab_chunk_size=vocab_chunk_size, temperature=temperature))
  logp, ent = jax.lax.map(per_chunk, (hidden, targets))  # [n, B, C] each
  logp = logp.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :length]  # [B, T]
  ent = ent.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :length]  # [B, T]
  return logp, ent


def _vocab_chunks(vocab: int, target: int) -> tuple[int, int]:
  """(number of chunks, chunk width) covering `vocab` with chunks of about `target` columns.

  Prefers a width that divides the vocabulary (no waste); otherwise the last chunk starts at V - width and overlaps
  its predecessor, the overlap being masked (see `_chunk_logprobs`), so the unembedding is never padded or copied.
  """
  if target >= vocab:
    return 1, vocab
  count = -(-vocab // target)
  for n in range(count, 2 * count + 1):
    if vocab % n == 0:
      return n, vocab // n
  return count, target


def _chunk_logprobs(inputs: tuple[jax.Array, jax.Array], *, unembedding: jax.Array, vocab_chunk_size: int,
                    temperature: float) -> tuple[jax.Array, jax.Array]:
  """One sequence chunk: hidden [B, C, D], targets [B, C] -> (logprobs, entropies) [B, C] via an online softmax.

  Carry per position: running max m, s = sum exp(l - m), u = sum exp(l - m) (l - m), and the target's logit. Then
  log Z = m + log s, and the entropy H = log Z - E[l] = log s - u / s.
  """
  hidden, targets = inputs
  vocab = unembedding.shape[1]
  num_chunks, chunk = _vocab_chunks(vocab, vocab_chunk_size)
  hidden = hidden.astype(unembedding.dtype)
  inv_t = jnp.float32(1.0 / temperature)

  def step(carry, index):
    m, s, u, target_logit = carry
    nominal = index * chunk
    start = jnp.minimum(nominal, vocab - chunk)
    w = jax.lax.dynamic_slice_in_dim(unembedding, start, chunk, axis=1)  # [D, Vc]
    logits = jnp.einsum("bcd,dv->bcv", hidden, w, preferred_element_type=jnp.float32) * inv_t  # [B, C, Vc]
    column = start + jnp.arange(chunk)  # [Vc]
    valid = column >= nominal  # [Vc]: False on the overlap already counted by the previous chunk
    logits = jnp.where(valid, logits, -jnp.inf)
    new_m = jnp.maximum(m, jnp.max(logits, axis=-1))  # [B, C]
    scale = jnp.exp(m - new_m)
    centred = jnp.where(valid, logits - new_m[..., None], 0.0)  # [B, C, Vc]
    e = jnp.where(valid, jnp.exp(centred), 0.0)
    # Re-centre the old sums on the new max: sum e^{l-m'} (l-m') = e^{m-m'} (u + s (m - m')).
    u = scale * (u + s * (m - new_m)) + jnp.sum(e * centred, axis=-1)
    s = scale * s + jnp.sum(e, axis=-1)
    hit = column == targets[..., None]  # [B, C, Vc]; the target lies in exactly one valid column
    target_logit = target_logit + jnp.sum(jnp.where(hit & valid, logits, 0.0), axis=-1)
    return (new_m, s, u, target_logit), None

  shape = targets.shape
  # m starts at the most negative finite float, not -inf: s (m - m') must be 0, not 0 * inf = NaN (also in grads).
  zeros = jnp.zeros(shape, jnp.float32)
  init = (jnp.full(shape, jnp.finfo(jnp.float32).min, jnp.float32), zeros, zeros, zeros)
  if num_chunks == 1:
    (m, s, u, target_logit), _ = step(init, jnp.zeros((), jnp.int32))
  else:
    (m, s, u, target_logit), _ = jax.lax.scan(jax.checkpoint(step), init, jnp.arange(num_chunks))
  log_z = m + jnp.log(s)
  return target_logit - log_z, jnp.log(s) - u / s


@functools.lru_cache(maxsize=32)
def _jitted_score(graphdef: Any, chunk_size: int, vocab_chunk_size: int, temperature: float) -> Any:
  def fn(params, input_ids, attention_mask):
    model = nnx.merge(graphdef, params)
    return score(model, input_ids, attention_mask, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
                 temperature=temperature)
  return jax.jit(fn)


def score_jit(model: nnx.Module, input_ids: Any, attention_mask: Any, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
              vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
              temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Jitted `score` for host callers (ExGRPO's answer selection, evaluation): one compile per shape and setting.

  Inputs may be numpy; under a mesh, put them on the batch sharding first (`jaxrlvr.parallel.batch_sharding`).
  """
  graphdef, params = nnx.split(model)
  fn = _jitted_score(graphdef, int(chunk_size), int(vocab_chunk_size), float(temperature))
  return fn(params, jnp.asarray(input_ids), jnp.asarray(attention_mask))
