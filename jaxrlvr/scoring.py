"""Teacher-forced per-token log-probs and entropies, without ever holding full [B, T, V] float32 logits.

The trainer calls `score` inside its loss (old log-probs, the policy ratio, the entropy bonus) and ExGRPO calls it to
pick the lowest-entropy stored answer. With a 152k vocabulary and 8k tokens, full fp32 logits would be ~5 GB per
sequence, so the final projection is done in chunks: a `lax.map` over sequence chunks of `chunk_size` positions, and
inside each a `lax.scan` over vocabulary chunks with an online log-sum-exp. The backward pass is written out
(`_head_bwd`, a custom VJP): it keeps only log Z and the mean logit per position from the forward pass and computes
each logits block once more, where remat with autodiff computed it twice more and stored the softmax. Peak logits
memory is [B, chunk_size, vocab_chunk_size] (forward and backward). Where the whole [B, T, V] logits are small (the
update's `train.keep_logits_mb`, `logits_kept`), `keep_logits=True` computes them in one product and keeps them for
the backward pass instead: one vocabulary-wide product fewer (the smollm2-135m preset's update: 1.28 -> 1.04 s in
the head, docs/benchmarks.md).

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


def score(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array | None, *,
          chunk_size: int = DEFAULT_CHUNK_SIZE, vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
          temperature: float = 1.0, positions: jax.Array | None = None, last: int | None = None,
          keep_logits: bool = False, segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Teacher-forced (logprobs [B, T], entropies [B, T]) float32 of `input_ids` [B, T] under `model`; with `last`,
  those of the last `last` positions only ([B, last] each): the vocabulary-wide head then runs on those positions
  alone, which is all an update over completions needs (on the smollm2-135m preset's 64 + 64 tokens, half of it).

  Pure and differentiable w.r.t. the model's parameters; call it inside your own jit (see `score_jit` for a jitted
  wrapper). `attention_mask` [B, T] marks real tokens (left padding before the prompt, right padding after the
  answer); RoPE positions default to the model's cumsum(mask) - 1, which is what the sampler uses. `keep_logits`:
  see `chunked_logprobs`. Packed rows (several sequences one after another, `Transformer.hidden`) pass
  `segment_ids` [B, T] and `positions` instead of `attention_mask` (None). A sequence's first token has no
  prediction of its own there (it is read from the previous sequence's last state), so sum over a mask of the tokens
  that have one (a prompt's completion: `warm_start.pack_rows`).

  Under a mesh the batch stays sharded over ('data', 'fsdp') through the chunks. When the vocabulary is sharded
  over 'tensor', slicing it into chunks makes XLA gather the unembedding; there each device already holds only
  V / tensor columns, so pass vocab_chunk_size >= vocab_size (one chunk, no slicing) unless memory says otherwise.
  """
  if temperature <= 0:
    raise ValueError(f"scoring.py: temperature={temperature} must be > 0 (score greedy rollouts at temperature 1)")
  if chunk_size < 1 or vocab_chunk_size < 1:
    raise ValueError(f"scoring.py: chunk_size={chunk_size} and vocab_chunk_size={vocab_chunk_size} must be >= 1")
  if segment_ids is not None:
    attention_mask = segment_ids > 0
  if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
    raise ValueError(f"scoring.py: input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must be the "
                     "same [B, T] shape")
  batch, length = input_ids.shape
  scored = length if last is None else last
  if not 1 <= scored <= length:
    raise ValueError(f"scoring.py: last={last} must be in [1, {length}], the sequence length")
  hidden, _ = model.hidden(input_ids, positions=positions, segment_ids=segment_ids,
                           attention_mask=None if segment_ids is not None else attention_mask)  # [B, T, D]
  # Token t's log-prob is read from hidden[:, t - 1]; token 0 has no predecessor and scores 0.
  start = length - scored
  first = max(start, 1)
  logp, ent = chunked_logprobs(hidden[:, first - 1:length - 1], model.unembedding(), input_ids[:, first:],
                               chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size, temperature=temperature,
                               keep_logits=keep_logits)  # [B, T - first] each
  if first > start:
    zero = jnp.zeros((batch, 1), jnp.float32)
    logp, ent = jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, ent], axis=1)
  keep = attention_mask[:, start:].astype(bool)
  return jnp.where(keep, logp, 0.0), jnp.where(keep, ent, 0.0)


def score_shared_prompts(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array, *, group_size: int,
                         prompt_len: int, chunk_size: int = DEFAULT_CHUNK_SIZE,
                         vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
                         temperature: float = 1.0, keep_logits: bool = False) -> tuple[jax.Array, jax.Array]:
  """`score(model, input_ids, attention_mask, last=S - prompt_len)` for rows whose prompts come in groups: every
  block of `group_size` consecutive rows shares its first `prompt_len` columns (ids and mask), as a GRPO group's
  samples share their question. Each prompt runs through the model once and its keys and values serve all the
  group's completions, so the update computes R / K prompts instead of R (the smollm2-135m preset's 64 + 64 tokens
  x 4 samples: 37% fewer tokens through the body). Same values up to float rounding, differentiable; the caller
  checks the sharing (`rollout.prompts_shared`), this function does not.
  """
  rows, length = input_ids.shape
  completion_len = length - prompt_len
  if group_size < 1 or rows % group_size or not 1 <= prompt_len < length:
    raise ValueError(f"scoring.py: {rows} rows of {length} tokens do not split into groups of {group_size} with a "
                     f"prompt of {prompt_len} tokens")
  _, prompt_hidden, cache = _group_prompts(model, input_ids, attention_mask, group_size, prompt_len)

  def per_row(kv: jax.Array) -> jax.Array:
    """[G, K, P, H] -> [R, K, P + T, H]: each row's cache holds its group's prompt, then room for its completion."""
    kv = jnp.repeat(kv, group_size, axis=0)
    return jnp.pad(kv, ((0, 0), (0, 0), (0, completion_len), (0, 0)))

  completion_ids = input_ids[:, prompt_len:]  # [R, T]
  completion_hidden, _ = model.hidden(completion_ids, attention_mask=attention_mask,
                                      cache=jax.tree.map(per_row, cache), cache_index=prompt_len)  # [R, T, D]
  # Completion token t is read from the hidden state before it: the prompt's last for t = 0.
  last_prompt = jnp.repeat(prompt_hidden[:, -1:], group_size, axis=0)  # [R, 1, D]
  hidden = jnp.concatenate([last_prompt, completion_hidden[:, :-1]], axis=1)  # [R, T, D]
  logp, ent = chunked_logprobs(hidden, model.unembedding(), completion_ids, chunk_size=chunk_size,
                               vocab_chunk_size=vocab_chunk_size, temperature=temperature,
                               keep_logits=keep_logits)  # [R, T] each
  keep = attention_mask[:, prompt_len:].astype(bool)
  return jnp.where(keep, logp, 0.0), jnp.where(keep, ent, 0.0)


def _group_prompts(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array, group_size: int,
                   prompt_len: int) -> tuple[jax.Array, jax.Array, Any]:
  """Each group's prompt (the first `prompt_len` columns of its first row) through the model once: its mask
  [G, P], its hidden states [G, P, D] and its KV cache ([G, K, P, H] a layer)."""
  rows, length = input_ids.shape
  groups = rows // group_size
  prompt_ids = input_ids.reshape(groups, group_size, length)[:, 0, :prompt_len]  # [G, P], one row per group
  prompt_mask = attention_mask.reshape(groups, group_size, length)[:, 0, :prompt_len]  # [G, P]
  cache = model.init_cache(groups, prompt_len)
  prompt_hidden, cache = model.hidden(prompt_ids, attention_mask=prompt_mask, cache=cache, cache_index=0)  # [G, P, D]
  return prompt_mask, prompt_hidden, cache


def score_packed_completions(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array, packing: dict,
                             unpack: jax.Array, *, group_size: int, prompt_len: int,
                             chunk_size: int = DEFAULT_CHUNK_SIZE, vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
                             temperature: float = 1.0, keep_logits: bool = False) -> tuple[jax.Array, jax.Array]:
  """`score_shared_prompts` of the same rows with their completions packed: a packed row of the completion width
  holds several completions one after another, each after its own group's prompt, so the body and the head run over
  the Rp packed rows instead of the R rows (RL answers are ragged: the smollm2-135m preset's fill three quarters of
  their 64 tokens). Same values up to float rounding, differentiable. The plan comes from the host
  (`packing.plan_batch`):

    packing["ids"], ["positions"] [Rp, T] int32: the packed tokens and their RoPE positions (their prompt's length
      plus their place in their completion);
    packing["segments"] [Rp, T] int32: each token's completion within its packed row (1, 2, ...; 0: padding);
    packing["prompts"] [Rp, M] int32: the group whose prompt is the row's prompt block m (M blocks a row);
    packing["blocks"] [Rp, T] int32: the prompt block each token's completion follows;
    packing["starts"] [Rp, T] bool: the first token of a completion (read from its prompt's last state);
    unpack [R, T] int32: where each row's completion token sits in the flat [Rp x T] packed tokens (Rp x T for
      the padding: log-prob and entropy 0).

  A packed row's keys are its M prompt blocks (from the group's prompt pass, as in `score_shared_prompts`) and then
  its own tokens; a token sees its own prompt block's real slots and the earlier tokens of its own completion.
  """
  width = input_ids.shape[1] - prompt_len
  prompt_mask, prompt_hidden, cache = _group_prompts(model, input_ids, attention_mask, group_size, prompt_len)
  ids, prompts, blocks = packing["ids"], packing["prompts"], packing["blocks"]
  packed_rows, num_blocks = prompts.shape

  def per_row(kv: jax.Array) -> jax.Array:
    """[G, K, P, H] -> [Rp, K, M P + T, H]: each packed row's prompt blocks, then room for its tokens."""
    kv = jnp.moveaxis(kv[prompts], 1, 2)  # [Rp, K, M, P, H]
    kv = kv.reshape(packed_rows, kv.shape[1], num_blocks * prompt_len, kv.shape[-1])  # [Rp, K, M P, H]
    return jnp.pad(kv, ((0, 0), (0, 0), (0, width), (0, 0)))

  mask = _packed_mask(prompt_mask.astype(bool), prompts, blocks, packing["segments"])  # [Rp, T, M P + T]
  packed_hidden, _ = model.hidden(ids, attention_mask=mask, positions=packing["positions"],
                                  cache=jax.tree.map(per_row, cache), cache_index=num_blocks * prompt_len)  # [Rp,T,D]
  # Token t is read from the state before it: for a completion's first token, its prompt's last.
  prompt_last = prompt_hidden[:, -1][jnp.take_along_axis(prompts, blocks, axis=1)]  # [Rp, T, D]
  before = jnp.pad(packed_hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))  # [Rp, T, D]
  hidden = jnp.where(packing["starts"][..., None], prompt_last, before)
  logp, ent = chunked_logprobs(hidden, model.unembedding(), ids, chunk_size=chunk_size,
                               vocab_chunk_size=vocab_chunk_size, temperature=temperature,
                               keep_logits=keep_logits)  # [Rp, T] each
  zero = jnp.zeros((1,), jnp.float32)
  return (jnp.concatenate([logp.reshape(-1), zero])[unpack],
          jnp.concatenate([ent.reshape(-1), zero])[unpack])  # [R, T] each


def _packed_mask(prompt_mask: jax.Array, prompts: jax.Array, blocks: jax.Array, segments: jax.Array) -> jax.Array:
  """[Rp, T, M P + T] bool: packed token t sees the real slots of its own prompt block and the tokens of its own
  completion up to itself; a padding token sees only itself (no softmax row is empty)."""
  packed_rows, num_blocks = prompts.shape
  width = segments.shape[1]
  real = segments > 0  # [Rp, T]
  own_block = (blocks[..., None] == jnp.arange(num_blocks)) & real[..., None]  # [Rp, T, M]
  prompt_part = own_block[..., None] & prompt_mask[prompts][:, None]  # [Rp, T, M, P]
  causal = jnp.arange(width)[None, :] <= jnp.arange(width)[:, None]  # [T, T]
  same = (segments[:, :, None] == segments[:, None, :]) & real[..., None]  # [Rp, T, T]
  completion_part = (causal & same) | jnp.eye(width, dtype=bool)
  return jnp.concatenate([prompt_part.reshape(packed_rows, width, -1), completion_part], axis=-1)


def chunked_logprobs(hidden: jax.Array, unembedding: jax.Array, targets: jax.Array, *, chunk_size: int,
                     vocab_chunk_size: int, temperature: float = 1.0,
                     keep_logits: bool = False) -> tuple[jax.Array, jax.Array]:
  """log softmax(hidden @ unembedding / T)[targets] and the entropy, per position: [B, T] each, float32.

  hidden [B, T, D], unembedding [D, V], targets [B, T] int. Sequence chunks of `chunk_size` (T is padded up to a
  multiple), vocabulary chunks of about `vocab_chunk_size` (see `_vocab_chunks`). With `keep_logits`, no chunks: the
  [B, T, V] float32 logits in one product, kept for the backward pass (`_head_kept`); only where they fit
  (`logits_kept`). The same values up to float rounding.
  """
  if keep_logits:
    return _head_kept(hidden, unembedding, targets, float(temperature))
  batch, length, width = hidden.shape
  chunk = min(chunk_size, length)
  num_chunks = -(-length // chunk)
  pad = num_chunks * chunk - length
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  hidden = hidden.reshape(batch, num_chunks, chunk, width).swapaxes(0, 1)  # [n, B, C, D]
  targets = targets.reshape(batch, num_chunks, chunk).swapaxes(0, 1)  # [n, B, C]
  per_chunk = functools.partial(_chunk_logprobs, unembedding=unembedding, vocab_chunk_size=vocab_chunk_size,
                                temperature=temperature)
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


# A logit this far below any real one gets weight exp(-1e30) = 0 in every sum, and keeps 0 * logit finite.
_MASKED_LOGIT = -1e30


def _vocab_slice(unembedding: jax.Array, index: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Vocabulary chunk `index`: its columns of the unembedding [D, Vc], their token ids [Vc] and a logit bias [Vc].
  The last chunk starts at V - Vc; on its overlap with the chunk before (already counted there) the id is -1 (no
  target matches it) and the bias _MASKED_LOGIT. Both are [Vc] vectors added or compared to the [B, C, Vc] logits,
  never masks of the logits' shape: those depend on nothing but the chunk index, so JAX's partial evaluation would
  hoist them out of the sequence-chunk map as one full-logits-sized array."""
  vocab = unembedding.shape[1]
  nominal = index * chunk
  start = jnp.minimum(nominal, vocab - chunk)
  column = start + jnp.arange(chunk)  # [Vc]
  valid = column >= nominal  # [Vc]
  bias = jnp.where(valid, 0.0, _MASKED_LOGIT).astype(jnp.float32)
  return jax.lax.dynamic_slice_in_dim(unembedding, start, chunk, axis=1), jnp.where(valid, column, -1), bias


def _chunk_logprobs(inputs: tuple[jax.Array, jax.Array], *, unembedding: jax.Array, vocab_chunk_size: int,
                    temperature: float) -> tuple[jax.Array, jax.Array]:
  """One sequence chunk: hidden [B, C, D], targets [B, C] -> (logprobs, entropies) [B, C] (see `_head`)."""
  hidden, targets = inputs
  return _head(hidden, unembedding, targets, vocab_chunk_size, float(temperature))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head(hidden: jax.Array, unembedding: jax.Array, targets: jax.Array, vocab_chunk_size: int,
          temperature: float) -> tuple[jax.Array, jax.Array]:
  """(logprobs, entropies) [B, C] of hidden [B, C, D] against unembedding [D, V], an online softmax over vocabulary
  chunks; the VJP is written out (`_head_bwd`)."""
  return _head_fwd(hidden, unembedding, targets, vocab_chunk_size, temperature)[0]


def _head_fwd(hidden, unembedding, targets, vocab_chunk_size, temperature):
  """Carry per position: running max m, s = sum exp(l - m), u = sum exp(l - m) (l - m), and the target's logit. Then
  log Z = m + log s, and the entropy H = log Z - E[l] = log s - u / s. Saved for the backward pass: log Z and E[l]
  per position ([B, C]), no logits."""
  num_chunks, chunk = _vocab_chunks(unembedding.shape[1], vocab_chunk_size)
  hidden_c = hidden.astype(unembedding.dtype)
  inv_t = jnp.float32(1.0 / temperature)

  def step(carry, index):
    m, s, u, target_logit = carry
    w, column, bias = _vocab_slice(unembedding, index, chunk)
    logits = jnp.einsum("bcd,dv->bcv", hidden_c, w, preferred_element_type=jnp.float32) * inv_t + bias  # [B, C, Vc]
    new_m = jnp.maximum(m, jnp.max(logits, axis=-1))  # [B, C]
    scale = jnp.exp(m - new_m)
    centred = logits - new_m[..., None]  # [B, C, Vc]
    e = jnp.exp(centred)  # 0 on masked columns, where e * centred = 0 * -1e30 = 0
    # Re-centre the old sums on the new max: sum e^{l-m'} (l-m') = e^{m-m'} (u + s (m - m')).
    u = scale * (u + s * (m - new_m)) + jnp.sum(e * centred, axis=-1)
    s = scale * s + jnp.sum(e, axis=-1)
    hit = column == targets[..., None]  # [B, C, Vc]: the target, in exactly one unmasked column
    target_logit = target_logit + jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    return (new_m, s, u, target_logit), None

  shape = targets.shape
  # m starts at the most negative finite float, not -inf: s (m - m') must be 0, not 0 * inf = NaN.
  zeros = jnp.zeros(shape, jnp.float32)
  init = (jnp.full(shape, jnp.finfo(jnp.float32).min, jnp.float32), zeros, zeros, zeros)
  (m, s, u, target_logit), _ = jax.lax.scan(step, init, jnp.arange(num_chunks))
  log_z = m + jnp.log(s)
  entropy = jnp.log(s) - u / s
  return (target_logit - log_z, entropy), (hidden, unembedding, targets, log_z, log_z - entropy)


def _head_bwd(vocab_chunk_size, temperature, residuals, cotangents):
  """Per vocabulary chunk, its logits computed once more, their cotangent (`_logits_cotangent`), then d hidden and
  that chunk's d w."""
  hidden, unembedding, targets, log_z, mean_logit = residuals
  d_logp, d_entropy = cotangents  # [B, C] each
  num_chunks, chunk = _vocab_chunks(unembedding.shape[1], vocab_chunk_size)
  hidden_c = hidden.astype(unembedding.dtype)
  inv_t = jnp.float32(1.0 / temperature)

  def step(carry, index):
    d_hidden, d_unembedding = carry
    w, column, bias = _vocab_slice(unembedding, index, chunk)
    logits = jnp.einsum("bcd,dv->bcv", hidden_c, w, preferred_element_type=jnp.float32) * inv_t + bias  # [B, C, Vc]
    hit = column == targets[..., None]
    d_logits = _logits_cotangent(logits, hit, log_z, mean_logit, d_logp, d_entropy, inv_t).astype(w.dtype)
    d_hidden = d_hidden + jnp.einsum("bcv,dv->bcd", d_logits, w, preferred_element_type=jnp.float32)
    d_w = jnp.einsum("bcd,bcv->dv", hidden_c, d_logits, preferred_element_type=jnp.float32)  # [D, Vc]
    # The overlap columns of the last chunk got zero d_logits above, so adding the whole slice is exact.
    start = jnp.minimum(index * chunk, unembedding.shape[1] - chunk)
    current = jax.lax.dynamic_slice_in_dim(d_unembedding, start, chunk, axis=1)
    d_unembedding = jax.lax.dynamic_update_slice_in_dim(d_unembedding, current + d_w, start, axis=1)
    return (d_hidden, d_unembedding), None

  init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(unembedding.shape, jnp.float32))
  (d_hidden, d_unembedding), _ = jax.lax.scan(step, init, jnp.arange(num_chunks))
  return d_hidden.astype(hidden.dtype), d_unembedding.astype(unembedding.dtype), None


_head.defvjp(_head_fwd, _head_bwd)


def _logits_cotangent(logits, hit, log_z, mean_logit, d_logp, d_entropy, inv_t) -> jax.Array:
  """d (hidden . w) [B, C, Vc] from the cotangents [B, C] of the log-prob and the entropy: with p = softmax(l) and
  l = hidden . w / T, d logp / d l = onehot(target) - p and d H / d l = -p (l - E[l]). `hit` marks each position's
  target column; p is 0 on masked columns."""
  p = jnp.exp(logits - log_z[..., None])
  return (d_logp[..., None] * (hit.astype(jnp.float32) - p)
          - d_entropy[..., None] * p * (logits - mean_logit[..., None])) * inv_t


def logits_kept(rows: int, positions: int, vocab: int, budget_mb: float) -> bool:
  """Whether the update's head keeps its logits for the backward pass (`chunked_logprobs(keep_logits=True)`):
  when [rows, positions, vocab] float32, one device's micro-batch, takes at most `budget_mb` MB."""
  return rows * positions * vocab * 4 <= budget_mb * 2**20


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head_kept(hidden: jax.Array, unembedding: jax.Array, targets: jax.Array,
               temperature: float) -> tuple[jax.Array, jax.Array]:
  """(logprobs, entropies) [B, T] of hidden [B, T, D] against unembedding [D, V] from the whole [B, T, V] float32
  logits, which the backward pass reuses: one vocabulary-wide product fewer than `_head`, at B x T x V x 4 bytes."""
  return _head_kept_fwd(hidden, unembedding, targets, temperature)[0]


def _head_kept_fwd(hidden, unembedding, targets, temperature):
  inv_t = jnp.float32(1.0 / temperature)
  logits = jnp.einsum("btd,dv->btv", hidden.astype(unembedding.dtype), unembedding,
                      preferred_element_type=jnp.float32) * inv_t  # [B, T, V]
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
  mean_logit = jnp.sum(jnp.exp(logits - log_z[..., None]) * logits, axis=-1)  # E[l], [B, T]
  # A masked sum rather than a gather: with the vocabulary split over 'tensor', each device sums its own columns.
  target_logit = jnp.sum(jnp.where(jnp.arange(logits.shape[-1]) == targets[..., None], logits, 0.0), axis=-1)
  return (target_logit - log_z, log_z - mean_logit), (hidden, unembedding, targets, logits, log_z, mean_logit)


def _head_kept_bwd(temperature, residuals, cotangents):
  hidden, unembedding, targets, logits, log_z, mean_logit = residuals
  d_logp, d_entropy = cotangents  # [B, T] each
  hit = jnp.arange(unembedding.shape[1]) == targets[..., None]  # [B, T, V]
  d_logits = _logits_cotangent(logits, hit, log_z, mean_logit, d_logp, d_entropy,
                               jnp.float32(1.0 / temperature)).astype(unembedding.dtype)  # [B, T, V]
  d_hidden = jnp.einsum("btv,dv->btd", d_logits, unembedding, preferred_element_type=jnp.float32)
  d_unembedding = jnp.einsum("btd,btv->dv", hidden.astype(unembedding.dtype), d_logits,
                             preferred_element_type=jnp.float32)
  return d_hidden.astype(hidden.dtype), d_unembedding.astype(unembedding.dtype), None


_head_kept.defvjp(_head_kept_fwd, _head_kept_bwd)


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
