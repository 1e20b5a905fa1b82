"""What every sampler of the package shares: its output type and the draw of one token from logits.

`jaxrlvr.rollout.sampler` (the static sampler) and `jaxrlvr.rollout.engine` (the rollout engine) both sample through `sample`, so
their tokens, log-probs and entropies follow one set of conventions (see `jaxrlvr.rollout.sampler`'s module docstring): the
log-probs and entropies are those of the distribution actually sampled from, greedy reports temperature-1 values,
and a token is drawn by inverse-CDF sampling from one uniform number.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlvr.rollout.bounded import BATCH_AXES


@dataclasses.dataclass(frozen=True)
class SampleOutput:
  """What `generate` returns, as host numpy arrays with one row per prompt (padding rows removed).

  tokens [B, N] int32, pad_id after the stop; logprobs [B, N] float32 and entropies [B, N] float32 of the sampled
  distribution, 0 after the stop; lengths [B] int32 up to and including the first stop token; logits [B, N, V]
  float32 raw model logits (temperature 1) only when `return_logits=True`, else None.
  """
  tokens: np.ndarray
  logprobs: np.ndarray
  entropies: np.ndarray
  lengths: np.ndarray
  logits: np.ndarray | None = None


def sample_logits(logits: jax.Array, rng: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draws one token from each row of `logits` [..., V] (one key for all rows).

  The order is the one transformers uses: temperature, then top-k, then top-p (nucleus: the smallest set of tokens
  whose probability, after top-k, reaches top_p; the most likely token is always kept; ties at the cut-off are kept).
  Returns (tokens [...] int32, logprobs [...] f32, entropies [...] f32) of the distribution actually sampled from;
  temperature 0 is greedy with temperature-1 log-prob and entropy (see the module docstring).
  """
  uniform = jax.random.uniform(rng, logits.shape[:-1])
  return sample(logits, uniform, temperature, top_p, top_k=top_k, nucleus=top_p < 1.0)


def sample(logits: jax.Array, uniform: jax.Array, temperature: Any, top_p: Any, *, top_k: int,
           nucleus: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`sample_logits` given the uniform draw [...] of each row; temperature and top_p may be traced.

  Temperature 0 is greedy. A Python number decides that when the function is traced; a traced temperature decides
  it when it runs (`lax.cond`, one branch executed), so one compiled sampler serves a run's greedy evaluation and its
  sampled rollouts where their shapes agree, instead of two compiles of the same loop.
  """
  logits = logits.astype(jnp.float32)
  draw = lambda: _draw(logits, uniform, temperature, top_p, top_k=top_k, nucleus=nucleus)
  if isinstance(temperature, (int, float, np.number)):
    return _greedy(logits) if temperature == 0 else draw()
  return jax.lax.cond(jnp.asarray(temperature) == 0, lambda: _greedy(logits), draw)


def _greedy(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  logp = jax.nn.log_softmax(logits, axis=-1)
  tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return tokens, _take(logp, tokens), _entropy(logp)


def _draw(logits: jax.Array, uniform: jax.Array, temperature: Any, top_p: Any, *, top_k: int,
          nucleus: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  scaled = logits / jnp.asarray(temperature, jnp.float32)
  vocab = scaled.shape[-1]
  sorted_desc = None  # the kept logits in descending order, when top-k or top-p needs them
  if 0 < top_k < vocab:
    sorted_desc, _ = jax.lax.top_k(scaled, top_k)  # [..., k]
    scaled = jnp.where(scaled < sorted_desc[..., -1:], -jnp.inf, scaled)
  if nucleus:
    if sorted_desc is None:
      sorted_desc = -jnp.sort(-scaled, axis=-1)  # [..., V]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p  # the first token always has mass_before 0
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
  logp = jax.nn.log_softmax(scaled, axis=-1)  # -inf outside the kept set
  tokens = _inverse_cdf(jnp.exp(logp), uniform)
  return tokens, _take(logp, tokens), _entropy(logp)


# Tokens a block of the two-level inverse CDF below: ~sqrt(V) for the vocabularies of the presets (49,152-151,936).
_CDF_BLOCK = 256


def _inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
  """The token whose cumulative-probability interval holds u * total: probs [..., V], u [...] in [0, 1).

  One uniform per row instead of the V Gumbel draws of `jax.random.categorical`: on CPU, generating the random bits
  cost ~8x the rest of the sampling step at V = 8192. In two levels: the block of `_CDF_BLOCK` tokens whose interval
  holds the target, then the token inside that block. A cumulative sum over all V is an associative scan on CPU
  (log2 V passes over [..., V]): at V = 49,152 and 16 rows it took 4.2 ms against 0.3 ms in two levels, and a whole
  draw (`sample`) 3.9 ms against 1.6 ms.
  Zero-probability tokens have empty intervals and are never drawn: each level counts the entries whose cumulative
  sum is <= the target (a sum of non-negative terms never decreases), and where rounding puts the target at or past
  a level's total, it takes that level's last entry with probability.
  """
  vocab = probs.shape[-1]
  blocks = -(-vocab // _CDF_BLOCK)
  padding = [(0, 0)] * (probs.ndim - 1) + [(0, blocks * _CDF_BLOCK - vocab)]
  tiled = jnp.pad(probs, padding).reshape(*probs.shape[:-1], blocks, _CDF_BLOCK)  # [..., blocks, block]; pad: p = 0
  block_mass = jnp.sum(tiled, axis=-1)  # [..., blocks]
  block_cdf = jnp.cumsum(block_mass, axis=-1)
  target = u * block_cdf[..., -1]
  block = jnp.minimum(jnp.sum(block_cdf <= target[..., None], axis=-1), _last_positive(block_mass))  # [...]
  mass_before = jnp.where(block > 0, _take(block_cdf, jnp.maximum(block - 1, 0)), 0.0)  # <= target
  inside = jnp.take_along_axis(tiled, block[..., None, None], axis=-2)[..., 0, :]  # [..., block]
  inside_cdf = jnp.cumsum(inside, axis=-1)
  rest = target - mass_before
  index = jnp.minimum(jnp.sum(inside_cdf <= rest[..., None], axis=-1), _last_positive(inside))
  return (block * _CDF_BLOCK + index).astype(jnp.int32)


def _last_positive(x: jax.Array) -> jax.Array:
  """The index of the last entry > 0 along the last axis of x [..., N] (0 when there is none)."""
  return x.shape[-1] - 1 - jnp.argmax(jnp.flip(x > 0, axis=-1), axis=-1)


def _take(logp: jax.Array, tokens: jax.Array) -> jax.Array:
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def _entropy(logp: jax.Array) -> jax.Array:
  """-sum p log p, with masked (-inf) entries contributing 0 rather than NaN."""
  p = jnp.exp(logp)
  return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)


# ----------------------------------------------------------------------------------------------------------------------
# The weights as a decode reads them.


def _without_batch_axes(axis: Any) -> Any:
  """A PartitionSpec entry with the batch axes taken out (None when nothing is left)."""
  if axis is None:
    return None
  kept = tuple(a for a in (axis if isinstance(axis, tuple) else (axis,)) if a not in BATCH_AXES)
  return None if not kept else kept[0] if len(kept) == 1 else kept


def decode_shardings(leaves: list, mesh: Any) -> tuple[NamedSharding, ...]:
  """The sharding each weight is read with in a decode loop: its own with the batch axes ('data', 'fsdp') dropped,
  so it stays split over 'tensor' only. `leaves` are arrays or ShapeDtypeStructs with NamedShardings (the planner's
  abstract ones).

  Why: trained with fsdp, every weight is split over the batch axes, and a decode step needs the whole of each. Left
  to itself XLA all-gathers every weight inside the decode `while` body, once per generated token (on TPU v5p-8 the
  7B decode moved all 197 weights, 14 GB, over the interconnect per token). Gathered once before the loop, the loop
  reads a resident copy.
  """
  spec_of = lambda x: x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else P()
  return tuple(NamedSharding(mesh, P(*(_without_batch_axes(a) for a in spec_of(x)))) for x in leaves)


def already_laid_out(leaves: list, shardings: tuple[NamedSharding, ...]) -> bool:
  """Whether every (concrete or abstract) leaf already has its decode sharding: one device, a data-parallel mesh."""
  return all(isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.is_equivalent_to(s, x.ndim)
             for x, s in zip(leaves, shardings))


def in_decode_layout(params: Any, shardings: tuple[NamedSharding, ...] | None, compute_dtype: Any) -> Any:
  """`params` (inside a jitted function) gathered into `shardings` (`decode_shardings`) and floating leaves cast to
  the compute dtype first, so the gather moves half-width bytes where the model computes in bfloat16 (the model
  casts every weight to it where it uses it, so no number changes). With `shardings` None: `params` unchanged."""
  if shardings is None:
    return params
  leaves, treedef = jax.tree.flatten(params)
  dtype = jnp.dtype(compute_dtype)
  # The barrier pins each cast to the shard, before its gather: left alone, XLA moved the cast after the gather,
  # and XLA:TPU, which gathers over 64 chips by writing each shard into a zeroed full-size buffer and all-reducing
  # it, built those buffers in float32 (7B decode on v5p:4x4x4: the embedding and the output projection, 2.18 GB
  # each; one layer's decode program held 5.73 GB of temporaries, 4.18 with the barrier).
  cast = lambda x: jax.lax.optimization_barrier(x.astype(dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.unflatten(treedef, [jax.lax.with_sharding_constraint(cast(x), s) for x, s in zip(leaves, shardings)])
