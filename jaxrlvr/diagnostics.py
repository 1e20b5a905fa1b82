"""Diagnostics of a policy-gradient update as pure functions: clip fractions, ratio statistics, approximate KL.

They come in two stages so that they survive micro-batching and sharding exactly:
  stats = policy_stats(...)                  # per micro-batch: additive partial statistics (counts, sums, max, min)
  stats = reduce_stats(stacked_stats)        # over the leading axis of `lax.scan` outputs, or carry
                                             # merge_stats(carry, stats) from empty_stats() in the scan
  metrics = finalize_stats(stats)            # on the device, once; fetch to the host on logging steps only
A mean of per-micro-batch means would weight micro-batches with few tokens too much; sums do not. Keys ending in
`_max` reduce with max, `_min` with min, every other key adds. Every statistic is well defined when there are no
tokens of a kind (e.g. no replayed tokens before ExGRPO's switch): its value is then 0, and `{kind}/tokens` says 0.
Nothing here is differentiated (inputs pass through `stop_gradient`).
"""
from __future__ import annotations

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from jaxrlvr import objectives

Array = jax.Array

KINDS = ("fresh", "replayed")


def policy_stats(logp: Any, old_logp: Any, advantages: Any, mask: Any, *, replayed: Any = None, clip: Any = True,
                 clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                 shaping_beta: float | None = 0.1) -> dict[str, Array]:
  """Partial statistics of one (micro-)batch; arguments as `objectives.token_policy_loss`, plus mask [B, T].

  Ratio statistics use w = exp(logp - old_logp), separately for fresh tokens (against pi_old) and replayed tokens
  (against the recorded pi_past). Clip counts are over the tokens that take the clipped path (fresh ones, and
  replayed ones too when shaping_beta is None) and count a token only where clipping is ACTIVE, i.e. its gradient is
  zeroed: A > 0 and w > 1 + clip_high (high), A < 0 and w < 1 - clip_low (low), A < 0 and w > dual_clip (dual), the
  same strict comparisons as the loss. With clip off they are 0.
  Ratio sums are kept as sums of (w - 1) and (w - 1)^2: ratios sit near 1, and shifting by 1 keeps the float32 variance
  from cancelling catastrophically.
  """
  logp = lax.stop_gradient(jnp.asarray(logp))
  shape = logp.shape
  dtype = objectives.compute_dtype(logp)
  per_token = objectives.broadcast_to_tokens
  log_ratio = jnp.clip((logp - lax.stop_gradient(per_token(old_logp, shape, "old_logp"))).astype(dtype),
                       -objectives.MAX_LOG_RATIO, objectives.MAX_LOG_RATIO)
  ratio = jnp.exp(log_ratio)
  adv = lax.stop_gradient(per_token(advantages, shape, "advantages")).astype(dtype)
  tokens = per_token(mask, shape, "mask") != 0
  is_replayed = jnp.zeros(shape, bool) if replayed is None else per_token(replayed, shape, "replayed").astype(bool)

  def count(x: Array) -> Array:
    return x.sum(dtype=jnp.int32)

  clip_path = tokens & ~is_replayed if shaping_beta is not None else tokens
  clip_on = jnp.asarray(clip, bool)
  clipping = clip_path & (per_token(clip_on, shape, "clip") if clip_on.ndim else clip_on)
  stats = {
      "tokens": count(tokens),
      "zero_adv_count": count(tokens & (adv == 0)),
      "clip_tokens": count(clip_path),
      "clip_high_count": count(clipping & (adv > 0) & (ratio > 1 + clip_high)),
      "clip_low_count": count(clipping & (adv < 0) & (ratio < 1 - clip_low)),
      "dual_clip_count": (count(clipping & (adv < 0) & (ratio > dual_clip)) if dual_clip is not None
                          else jnp.zeros((), jnp.int32)),
  }
  for kind, members in (("fresh", tokens & ~is_replayed), ("replayed", tokens & is_replayed)):
    dev = jnp.where(members, ratio - 1, 0)
    stats[f"{kind}/count"] = count(members)
    stats[f"{kind}/ratio_dev_sum"] = dev.sum()
    stats[f"{kind}/ratio_dev_sq_sum"] = (dev ** 2).sum()
    stats[f"{kind}/ratio_max"] = jnp.where(members, ratio, -jnp.inf).max()
    stats[f"{kind}/ratio_min"] = jnp.where(members, ratio, jnp.inf).min()
    # KL(pi_old || pi) from tokens sampled by pi_old: k1 = -log w (verl's ppo_kl), k3 = (w - 1) - log w (>= 0).
    stats[f"{kind}/kl_k1_sum"] = jnp.where(members, -log_ratio, 0).sum()
    stats[f"{kind}/kl_k3_sum"] = jnp.where(members, (ratio - 1) - log_ratio, 0).sum()
  return stats


def _reducer(key: str):
  if key.endswith("_max"):
    return jnp.max, jnp.maximum
  if key.endswith("_min"):
    return jnp.min, jnp.minimum
  return jnp.sum, jnp.add


def empty_stats(dtype: Any = jnp.float32) -> dict[str, Array]:
  """The identity of `merge_stats` (zero counts and sums, -inf maxima, +inf minima): a `lax.scan` carry's start."""
  shapes = jax.eval_shape(lambda: policy_stats(jnp.zeros((1, 1), dtype), jnp.zeros((1, 1), dtype), jnp.zeros(1),
                                               jnp.zeros((1, 1), bool)))
  fill = lambda k: -jnp.inf if k.endswith("_max") else jnp.inf if k.endswith("_min") else 0
  return {k: jnp.full(s.shape, fill(k), s.dtype) for k, s in shapes.items()}


def reduce_stats(stats: dict[str, Array], axis: int = 0) -> dict[str, Array]:
  """Combines partial statistics stacked along `axis` (e.g. the [M] leading axis of scanned micro-batches)."""
  return {k: _reducer(k)[0](v, axis=axis) for k, v in stats.items()}


def merge_stats(a: dict[str, Array], b: dict[str, Array]) -> dict[str, Array]:
  """Combines the partial statistics of two disjoint sets of tokens (e.g. a scan carry and a new micro-batch)."""
  if a.keys() != b.keys():
    raise ValueError(f"jaxrlvr/diagnostics.py: cannot merge stats with keys {sorted(a)} and {sorted(b)}")
  return {k: _reducer(k)[1](a[k], b[k]) for k in a}


def _safe_div(num: Array, den: Array) -> Array:
  num = jnp.asarray(num, jnp.float32)
  den = jnp.asarray(den, jnp.float32)
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), 0)


def finalize_stats(stats: dict[str, Array]) -> dict[str, Array]:
  """Metrics (float32 scalars) from partial statistics:

    tokens, zero_adv_frac           loss tokens; share of them whose advantage is exactly 0 (constant groups)
    clip_frac_low, clip_frac_high,  share of clipped-path tokens whose clip is active at 1 - clip_low, at
    dual_clip_frac                  1 + clip_high, at the dual-clip cap
    {fresh,replayed}/tokens         tokens of that kind
    {kind}/ratio_mean, _std,        population statistics of w over tokens of that kind (0 when there are none)
    {kind}/ratio_max, _min
    {kind}/approx_kl, _kl_k1        k3 and k1 estimates of KL(pi_old || pi) (pi_past for replayed tokens)
  """
  tokens = stats["tokens"]
  out = {
      "tokens": jnp.asarray(tokens, jnp.float32),
      "zero_adv_frac": _safe_div(stats["zero_adv_count"], tokens),
      "clip_frac_low": _safe_div(stats["clip_low_count"], stats["clip_tokens"]),
      "clip_frac_high": _safe_div(stats["clip_high_count"], stats["clip_tokens"]),
      "dual_clip_frac": _safe_div(stats["dual_clip_count"], stats["clip_tokens"]),
  }
  for kind in KINDS:
    n = stats[f"{kind}/count"]
    mean_dev = _safe_div(stats[f"{kind}/ratio_dev_sum"], n)
    var = jnp.maximum(_safe_div(stats[f"{kind}/ratio_dev_sq_sum"], n) - mean_dev ** 2, 0)
    some = n > 0
    out[f"{kind}/tokens"] = jnp.asarray(n, jnp.float32)
    out[f"{kind}/ratio_mean"] = jnp.where(some, 1 + mean_dev, 0)
    out[f"{kind}/ratio_std"] = jnp.sqrt(var)
    out[f"{kind}/ratio_max"] = jnp.where(some, stats[f"{kind}/ratio_max"], 0).astype(jnp.float32)
    out[f"{kind}/ratio_min"] = jnp.where(some, stats[f"{kind}/ratio_min"], 0).astype(jnp.float32)
    out[f"{kind}/approx_kl"] = _safe_div(stats[f"{kind}/kl_k3_sum"], n)
    out[f"{kind}/approx_kl_k1"] = _safe_div(stats[f"{kind}/kl_k1_sum"], n)
  return out


def policy_diagnostics(logp: Any, old_logp: Any, advantages: Any, mask: Any, **kwargs: Any) -> dict[str, Array]:
  """`finalize_stats(policy_stats(...))` for a whole batch at once (keywords as `policy_stats`)."""
  return finalize_stats(policy_stats(logp, old_logp, advantages, mask, **kwargs))
