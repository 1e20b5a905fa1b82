"""Pure loss functions for RL with verifiable rewards: advantages, per-token policy terms, aggregation, entropy, KL.

Every function here is a pure function of arrays: no host syncs, no Python branch on an array value, safe under
`jit`, `vmap` and `grad`. Hyperparameters (clip edges, mode names, caps) are Python values fixed at trace time;
only `clip` of `token_policy_loss` may also be a (traced) array.
Shapes: B sequences (rows) of T completion tokens; G groups of K samples; V vocabulary entries.

How the update step (step.py) must use these, so that micro-batching and data parallelism never change the gradient:

  normalizer = loss_normalizer(batch.mask, mode=mode, max_len=L)        # once, on the GLOBAL [N, T] mask
  def microbatch_loss(params, mb):                                     # inside lax.scan over micro-batches
    logp, entropy = ...                                                # [b, T] from the model
    per_token = token_policy_loss(logp, mb.old_logp, mb.advantages, replayed=mb.replayed, ...)
    per_token += kl_coef * kl_penalty(logp, mb.ref_logp) - entropy_coef * entropy   # combine before aggregating
    return aggregate_loss(per_token, mb.mask, mode=mode, max_len=L, normalizer=normalizer)
  grads = sum over micro-batches of grad(microbatch_loss)              # a SUM, never a mean over micro-batches

Every mode's loss is (sum over the global batch of a per-row numerator) / (a scalar that depends on the global mask
only), so the micro-batch losses with the global scalar add up to exactly the global loss and their gradients add up
to the global gradient, for any micro-batch count and any device count. Dividing the summed gradient by the number of
micro-batches, or normalising each micro-batch by its own token count, is the bug this design removes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "dr_grpo", "exgrpo_reference")
KL_ESTIMATORS = ("k1", "k2", "k3")
REFERENCE_WIDTHS = ("max_len", "padded")
# log-ratios are clamped to +-20 before exp, as verl's compute_policy_loss does: exp(20) ~ 4.9e8 is still finite, so
# the gradient of the branch `jnp.where` does not pick can never be inf (0 * inf = nan in the backward pass).
MAX_LOG_RATIO = 20.0


def _is_number(x: Any) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def compute_dtype(x: Array) -> Any:
  """Loss arithmetic in at least float32, even for bfloat16 log-probs."""
  return jnp.promote_types(x.dtype, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32


def broadcast_to_tokens(x: Any, shape: tuple[int, ...], name: str) -> Array:
  """Broadcasts a per-sequence [B] array (or a [B, T] one) to the per-token shape [B, T]."""
  x = jnp.asarray(x)
  given = x.shape
  if x.ndim == len(shape) - 1:
    x = x[..., None]  # [B, 1]
  if x.ndim != len(shape) or any(a not in (1, b) for a, b in zip(x.shape, shape)):
    raise ValueError(f"jaxrlvr/objectives.py: {name} has shape {given}; expected {shape[:-1]} or {shape}")
  return jnp.broadcast_to(x, shape)


def _check_mode(mode: str) -> None:
  if mode not in AGGREGATION_MODES:
    raise ValueError(f"jaxrlvr/objectives.py: aggregation mode (loss.aggregation) {mode!r} is not one of "
                     f"{', '.join(AGGREGATION_MODES)}")


# ----------------------------------------------------------------------------------------------------------------
# Advantages and shaping.


def group_advantages(rewards: Any, *, scale_by_std: bool = False, eps: float = 1e-6, mask: Any = None) -> Array:
  """Group-relative advantages: r - mean(r) over each group of K samples, optionally / (std + eps).

  rewards: [G, K]. Returns [G, K] in a float dtype (integer rewards become float32).
  scale_by_std=False is Dr.GRPO (the default; no bias toward easy or hard groups); True is classic GRPO. The std is
  the unbiased sample std (ddof=1, what `torch.std` and so verl and TRL use); it is the package's one convention
  for a group's std (the host-side `replay.base.group_std`, ExpRL's outcome advantages and advantage-priority's
  `group_std` priority use it too). A group of one sample, or whose rewards
  are all equal, gets advantage 0 in both cases.
  mask: optional [G, K] bool; samples with mask False (e.g. an ExpRL judge score that did not parse) are left out of
  their group's mean and std and get advantage 0.
  """
  rewards = jnp.asarray(rewards)
  if rewards.ndim != 2:
    raise ValueError(f"jaxrlvr/objectives.py: rewards must be [G, K], got shape {rewards.shape}")
  rewards = rewards.astype(compute_dtype(rewards))
  valid = jnp.ones(rewards.shape, bool) if mask is None else jnp.broadcast_to(jnp.asarray(mask, bool), rewards.shape)
  n = valid.sum(-1, keepdims=True).astype(rewards.dtype)  # [G, 1]
  mean = jnp.where(valid, rewards, 0).sum(-1, keepdims=True) / jnp.maximum(n, 1)
  centred = jnp.where(valid, rewards - mean, 0)
  if not scale_by_std:
    return centred
  var = (centred ** 2).sum(-1, keepdims=True) / jnp.maximum(n - 1, 1)
  # sqrt has an infinite derivative at 0, which would turn the (zero) gradient of a constant group into nan.
  std = jnp.where(var > 0, jnp.sqrt(jnp.where(var > 0, var, 1)), 0)
  return centred / (std + eps)


def policy_shaping(ratio: Any, *, beta: float = 0.1) -> Array:
  """ExGRPO's f(w) = w / (w + beta): amplifies low-probability replayed tokens, damps high-probability ones.

  f'(w) = beta / (w + beta)^2, so with w = exp(logp - recorded_logp), d f / d logp = beta * w / (w + beta)^2.
  """
  ratio = jnp.asarray(ratio)
  return ratio / (ratio + beta)


# ----------------------------------------------------------------------------------------------------------------
# Per-token policy loss.


def _check_clip_args(clip_low: Any, clip_high: Any, dual_clip: Any, shaping_beta: Any) -> None:
  if _is_number(clip_low) and not 0 <= clip_low <= 1:
    raise ValueError(f"jaxrlvr/objectives.py: clip_low (loss.clip_low) must be in [0, 1], got {clip_low}")
  if _is_number(clip_high) and clip_high < 0:
    raise ValueError(f"jaxrlvr/objectives.py: clip_high (loss.clip_high) must be >= 0, got {clip_high}")
  if _is_number(dual_clip) and dual_clip <= 1:
    raise ValueError(f"jaxrlvr/objectives.py: dual_clip (loss.dual_clip) must be > 1 or None (off), got {dual_clip}")
  if _is_number(shaping_beta) and shaping_beta <= 0:
    raise ValueError(f"jaxrlvr/objectives.py: shaping_beta (loss.shaping_beta) must be > 0 or None, got {shaping_beta}")


def token_policy_loss(logp: Any, old_logp: Any, advantages: Any, *, replayed: Any = None, clip: Any = True,
                      clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                      shaping_beta: float | None = 0.1) -> Array:
  """Per-token policy-gradient loss [B, T] (to be minimised); aggregate it with `aggregate_loss`.

  logp: [B, T] log-probs of the taken tokens under the policy being trained (differentiated).
  old_logp: [B, T] the log-probs the ratio is taken against: for fresh tokens the trainer's recomputed log-probs
    before the first optimizer step (pi_old); for replayed tokens the log-probs RECORDED when the answer was generated
    (pi_past), i.e. `jnp.where(replayed, recorded_logp, recomputed_logp)`.
  advantages: [B] or [B, T]. replayed: None, [B] or [B, T] bool. clip: a Python bool, or a bool array (scalar, [B] or
  [B, T]; may be traced), so that ExGRPO's switch that drops the clip of fresh tokens once replay is on needs neither
  a recompile nor a second call.

  With w = exp(logp - old_logp) and A the advantage:
    fresh, clip:    -min(w*A, clip(w, 1-clip_low, 1+clip_high)*A)
                    = -(1+clip_high)*A if A > 0 and w > 1+clip_high; -(1-clip_low)*A if A < 0 and w < 1-clip_low;
                      -w*A otherwise (clip_low != clip_high is DAPO's clip-higher).
    dual clip c:    for A < 0 the loss is also capped: min(the above, -c*A) (dual-clip PPO; c > 1), i.e. -c*A when
                    w > c.
    fresh, no clip: -w*A (dual clip off too).
    replayed:       -f(w)*A with f = policy_shaping(., beta=shaping_beta), never clipped; f(w) is computed as
                    sigmoid(log w - log beta), the same number without overflow for any log-ratio.
    shaping_beta=None: replayed tokens are treated exactly like fresh ones (advantage-priority replay, BAPO).

  Clip boundary (decision): a ratio exactly ON an edge counts as inside the trust region, so its gradient is the full
  unclipped -A*w. That is what the PPO/verl torch reference computes at 1-clip_low and 1+clip_high
  (`torch.maximum` splits a tie 1/2-1/2 and `torch.clamp` passes gradient 1 at its edges: 1/2 + 1/2*1 = 1), and it
  matches verl's clip fraction (`pg_losses2 > pg_losses1`, strict). A direct JAX port gets 3/4 there, because
  `jnp.clip` passes only 1/2 at its edges (and `lax.clamp` 0); so the clip is written as `jnp.where` with strict
  comparisons. At the dual-clip edge w == c we also keep the full gradient (verl's `torch.min` tie gives 1/2 there),
  for the same rule: the cap is active only strictly beyond c. Log-ratios are clamped to +-MAX_LOG_RATIO for the
  fresh-token ratio, as verl does.
  """
  _check_clip_args(clip_low, clip_high, dual_clip, shaping_beta)
  logp = jnp.asarray(logp)
  dtype = compute_dtype(logp)
  shape = logp.shape
  log_ratio = (logp - broadcast_to_tokens(old_logp, shape, "old_logp")).astype(dtype)
  adv = broadcast_to_tokens(advantages, shape, "advantages").astype(dtype)

  ratio = jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))
  clip_on = jnp.asarray(clip, bool)
  if clip_on.ndim:
    clip_on = broadcast_to_tokens(clip_on, shape, "clip")  # per row [B] or per token [B, T]
  high = clip_on & (adv > 0) & (ratio > 1 + clip_high)
  low = clip_on & (adv < 0) & (ratio < 1 - clip_low)
  # The clipped values are constants in logp: zero gradient inside the clipped region, -A*w outside and on the edge.
  fresh = jnp.where(high, -(1 + clip_high) * adv, jnp.where(low, -(1 - clip_low) * adv, -ratio * adv))
  if dual_clip is not None:
    fresh = jnp.where(clip_on & (adv < 0) & (ratio > dual_clip), -dual_clip * adv, fresh)
  if replayed is None or shaping_beta is None:
    return fresh
  shaped = jax.nn.sigmoid(log_ratio - jnp.log(jnp.asarray(shaping_beta, dtype)))  # w / (w + beta)
  return jnp.where(broadcast_to_tokens(replayed, shape, "replayed").astype(bool), -shaped * adv, fresh)


def truncated_importance_weights(old_logp: Any, behaviour_logp: Any, *, cap: float) -> Array:
  """Truncated importance weights min(pi_old / pi_behaviour, cap), a constant (stop-gradient) per token [B, T].

  old_logp: the trainer's log-probs of the taken tokens under the parameters before this update (pi_old, the same
  array `token_policy_loss` gets for fresh tokens); behaviour_logp: the log-probs the sampler recorded when it
  generated them (pi_behaviour: an older policy for BAPO's delayed rollouts and buffer rows, or the inference engine's
  numerics for sampler/trainer mismatch). weight = exp(min(old_logp - behaviour_logp, log cap)), which is
  min(exp(old_logp - behaviour_logp), cap) without overflow. Multiply the per-token loss by it:
  `token_policy_loss(...) * truncated_importance_weights(old, behaviour, cap=c)` (verl's TIS; BAPO uses cap 3).
  """
  if _is_number(cap) and cap <= 0:
    raise ValueError(f"jaxrlvr/objectives.py: importance cap (loss.importance_cap) must be > 0, got {cap}")
  old_logp = jnp.asarray(old_logp)
  dtype = compute_dtype(old_logp)
  log_w = (old_logp - jnp.asarray(behaviour_logp)).astype(dtype)
  return lax.stop_gradient(jnp.exp(jnp.minimum(log_w, jnp.log(jnp.asarray(cap, dtype)))))


def kl_penalty(logp: Any, ref_logp: Any, *, estimator: str = "k3") -> Array:
  """Per-token estimate [B, T] of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1, k2, k3).

  With x = logp - ref_logp:  k1 = x;  k2 = x^2 / 2;  k3 = exp(-x) - 1 + x (>= 0, low variance; verl's low_var_kl
  without its +-10 clamp of the result). x is clamped to +-MAX_LOG_RATIO inside k3's exp.
  As a LOSS their gradients differ: on-policy, the expected gradient of k1 is zero, k2's is the gradient of
  KL(pi || pi_ref), and k3's is that of the forward KL(pi_ref || pi). ref_logp comes from a frozen reference model.
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"jaxrlvr/objectives.py: KL estimator (loss.kl_estimator) {estimator!r} is not one of "
                     f"{', '.join(KL_ESTIMATORS)}")
  logp = jnp.asarray(logp)
  x = (logp - jnp.asarray(ref_logp)).astype(compute_dtype(logp))
  if estimator == "k1":
    return x
  if estimator == "k2":
    return 0.5 * x ** 2
  x = jnp.clip(x, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  return jnp.exp(-x) - 1 + x


# ----------------------------------------------------------------------------------------------------------------
# Aggregation: per-token loss -> scalar, with a normaliser that belongs to the whole global batch.


def loss_normalizer(mask: Any, *, mode: str = "dr_grpo", max_len: int | None = None, reference_ranks: int = 1,
                    reference_divisor: int = 1) -> Array:
  """The scalar denominator of `aggregate_loss` for `mode`, computed on the GLOBAL mask [N, T] (see module doc).

    token-mean:           number of loss tokens (sum of the mask).
    seq-mean-token-mean,
    seq-mean-token-sum:   N, the number of sequences with at least one loss token.
    dr_grpo:              N * L.
    exgrpo_reference:     L * reference_ranks * reference_divisor.
  L = max_len (a constant from the config), or the padded width T when None. N counts sequences with a token, so a
  row that is all padding (filler rows that keep per-host shapes equal) or fully masked (a dropped group, an
  unparsable judge score) is exactly as if it were not in the batch.

  exgrpo_reference is what the released ExGRPO code computes for one optimizer step: on each of R data-parallel
  ranks, every micro-batch's token sum is divided by the response width L and by the gradient-accumulation divisor
  D, the micro-batches of a rank add up, and the R ranks' gradients are averaged:
      (1/R) sum_r (1/D) sum_m (sum of rank r's micro-batch m) / L  =  (global token sum) / (L * R * D).
  With L a constant that is one scalar for the whole step. Defaults (R = D = 1) give sum / L: one micro-batch on
  one device. The update step passes R = the mesh's batch shards and D from `loss.reference_divisor`
  (LossSettings.normalizer_kwargs).
  """
  _check_mode(mode)
  m = jnp.asarray(mask)
  if max_len is not None and _is_number(max_len) and max_len <= 0:
    raise ValueError(f"jaxrlvr/objectives.py: max_len (loss.max_len) must be > 0 or None, got {max_len}")
  if reference_ranks < 1 or reference_divisor < 1:
    raise ValueError(f"jaxrlvr/objectives.py: reference_ranks ({reference_ranks}) and reference_divisor "
                     f"({reference_divisor}) must be >= 1")
  length = m.shape[-1] if max_len is None else max_len
  if mode == "token-mean":
    return m.astype(jnp.float32).sum()
  if mode == "exgrpo_reference":
    return jnp.asarray(length * reference_ranks * reference_divisor, jnp.float32)
  n_seq = jnp.any(m != 0, axis=-1).sum().astype(jnp.float32)
  return n_seq * length if mode == "dr_grpo" else n_seq


def aggregate_loss(per_token: Any, mask: Any, *, mode: str = "dr_grpo", max_len: int | None = None,
                   normalizer: Any = None) -> Array:
  """Scalar loss from a per-token loss [B, T] and a mask [B, T] (bool or float weights).

    token-mean:           sum_{n,t} m*l / sum m.
    seq-mean-token-mean:  (1/N) sum_n (sum_t m*l / sum_t m)      (rows without tokens add 0).
    seq-mean-token-sum:   (1/N) sum_n sum_t m*l.
    dr_grpo:              sum_{n,t} m*l / (N * L)                (the default; Dr.GRPO).
    exgrpo_reference:     sum_{n,t} m*l / L                      (the released ExGRPO code on one micro-batch and one
                          device; over micro-batches and devices the step passes the normaliser L * R * D that
                          reproduces the code's per-micro-batch division and rank average, see `loss_normalizer`).
  normalizer: None computes `loss_normalizer(mask, mode=mode, max_len=max_len)` from this mask, right for a whole
  batch. A micro-batch or a device shard MUST pass the normaliser of the global batch instead; then the sum of the
  micro-batch losses is the global loss (module doc). Masked tokens contribute 0 even when their loss is nan or inf.
  """
  _check_mode(mode)
  per_token = jnp.asarray(per_token)
  mask = jnp.asarray(mask)
  if per_token.shape != mask.shape:
    raise ValueError(f"jaxrlvr/objectives.py: per_token shape {per_token.shape} != mask shape {mask.shape}")
  dtype = compute_dtype(per_token)
  weights = mask.astype(dtype)
  token_terms = jnp.where(weights != 0, per_token.astype(dtype) * weights, 0)
  if mode == "seq-mean-token-mean":
    lengths = weights.sum(-1)  # [B]
    numerator = jnp.where(lengths > 0, token_terms.sum(-1) / jnp.where(lengths > 0, lengths, 1), 0).sum()
  else:
    numerator = token_terms.sum()
  if normalizer is None:
    normalizer = loss_normalizer(mask, mode=mode, max_len=max_len)
  normalizer = jnp.asarray(normalizer, dtype)
  return numerator / jnp.where(normalizer > 0, normalizer, 1)


def reference_entropy_term(entropy: Any, mask: Any, *, reference_ranks: int = 1, reference_divisor: int = 1) -> Array:
  """The released ExGRPO code's entropy bonus for one micro-batch [r, T] whose rows are `reference_ranks` blocks of
  r / R rows, one per data-parallel rank (the batch sharding cuts rows into contiguous blocks).

  Each rank takes the token mean of its rows' entropy (verl's masked_mean, 0 for a block without tokens) and
  divides it by the gradient-accumulation divisor D; a rank sums its micro-batches and the ranks' gradients are
  averaged, so this micro-batch adds (1/R) sum_b mean_b / D. Not the policy loss's normaliser: the bonus is a mean
  over each micro-batch's tokens whatever the loss's aggregation.
  """
  entropy, mask = jnp.asarray(entropy), jnp.asarray(mask)
  rows = entropy.shape[0]
  if rows % reference_ranks:
    raise ValueError(f"jaxrlvr/objectives.py: {rows} rows do not split into {reference_ranks} rank blocks")
  dtype = compute_dtype(entropy)
  weights = mask.astype(dtype).reshape(reference_ranks, -1)  # [R, r / R * T]
  total = jnp.where(weights != 0, entropy.astype(dtype).reshape(reference_ranks, -1) * weights, 0).sum(-1)  # [R]
  count = weights.sum(-1)
  means = jnp.where(count > 0, total / jnp.where(count > 0, count, 1), 0)  # [R]
  return means.sum() / (reference_ranks * reference_divisor)


def sequence_mean(values: Any, mask: Any) -> Array:
  """Masked mean over the last axis: [B, T] -> [B]; 0 for a row without tokens (e.g. mean entropy per answer)."""
  values = jnp.asarray(values)
  weights = jnp.asarray(mask).astype(compute_dtype(values))
  total = jnp.where(weights != 0, values * weights, 0).sum(-1)
  count = weights.sum(-1)
  return jnp.where(count > 0, total / jnp.where(count > 0, count, 1), 0)


# ----------------------------------------------------------------------------------------------------------------
# Log-probs and entropy from logits, chunked over the sequence.


def logprobs_and_entropy(logits: Any, targets: Any = None, *, chunk_size: int | None = None,
                         temperature: float = 1.0) -> tuple[Array | None, Array]:
  """Log-probs of `targets` and the entropy of the next-token distribution, per token, in float32: ([B, T], [B, T]).

  logits: [B, T, V], any float dtype (e.g. bfloat16 from the model); divided by `temperature` (the sampler's, so
  the log-probs are those of the sampling distribution). targets: [B, T] int token ids, or None for the entropy only
  (log-probs None). To avoid materialising the logits at all, score from hidden states with jaxrlvr/scoring.py,
  which chunks the unembedding too.
  The sequence is processed `chunk_size` positions at a time (None: all at once) under `jax.checkpoint`, so neither
  the forward nor the backward pass holds more than one chunk of float32 logits (measured with float32 logits; the
  XLA CPU backend widens a bfloat16 input to float32 as a whole before the loop, seen on the CPU backend).
  When T is not a multiple of the chunk, the last chunk is the final `chunk_size` positions (it overlaps the previous
  one; no padding copy). Logits must be finite (H = logsumexp(z) - sum softmax(z) * z).
  """
  logits = jnp.asarray(logits)
  batch, length = logits.shape[:2]
  chunk = length if chunk_size is None else min(int(chunk_size), length)
  if chunk <= 0:
    raise ValueError(f"jaxrlvr/objectives.py: chunk_size must be > 0, got {chunk_size}")
  n_chunks = -(-length // chunk)

  def chunk_stats(start: Array) -> tuple[Array, Array]:
    # The barrier stops XLA from hoisting the float32 convert out of the loop (a full-size f32 copy of the logits).
    z = lax.optimization_barrier(lax.dynamic_slice_in_dim(logits, start, chunk, axis=1))  # [B, c, V]
    z = z.astype(jnp.float32) / temperature
    log_z = jax.nn.logsumexp(z, axis=-1)  # [B, c]
    entropy = log_z - (jax.nn.softmax(z, axis=-1) * z).sum(-1)
    if targets is None:
      return jnp.zeros_like(entropy), entropy
    ids = lax.dynamic_slice_in_dim(jnp.asarray(targets), start, chunk, axis=1)  # [B, c]
    logp = jnp.take_along_axis(z, ids[..., None].astype(jnp.int32), axis=-1)[..., 0] - log_z
    return logp, entropy

  if n_chunks == 1:
    logp, entropy = chunk_stats(jnp.int32(0))
  else:
    starts = jnp.asarray(np.minimum(np.arange(n_chunks) * chunk, length - chunk), jnp.int32)
    stacked = lax.map(jax.checkpoint(chunk_stats), starts)  # ([n, B, c], [n, B, c])
    tail = length - (n_chunks - 1) * chunk  # positions of the last chunk not covered by the previous ones

    def unchunk(y: Array) -> Array:
      y = jnp.moveaxis(y, 0, 1)  # [B, n, c]
      body = y[:, :-1].reshape(batch, (n_chunks - 1) * chunk)  # [B, (n-1)*c]
      return jnp.concatenate([body, y[:, -1, chunk - tail:]], axis=1)  # [B, T]

    logp, entropy = unchunk(stacked[0]), unchunk(stacked[1])
  return (None if targets is None else logp), entropy


def token_entropy(logits: Any, *, chunk_size: int | None = None, temperature: float = 1.0) -> Array:
  """Entropy [B, T] of softmax(logits / temperature), float32, chunked (see `logprobs_and_entropy`)."""
  return logprobs_and_entropy(logits, None, chunk_size=chunk_size, temperature=temperature)[1]


def token_logprobs(logits: Any, targets: Any, *, chunk_size: int | None = None, temperature: float = 1.0) -> Array:
  """Log-probs [B, T] of `targets` under softmax(logits / temperature), float32, chunked."""
  return logprobs_and_entropy(logits, targets, chunk_size=chunk_size, temperature=temperature)[0]


# ----------------------------------------------------------------------------------------------------------------
# Group filters.


def constant_group_mask(rewards: Any, *, atol: float = 0.0) -> Array:
  """[G, K] -> [G] bool, True where all K rewards of a group are equal (within atol): zero advantage, no signal.

  Inside jit, drop such groups from the loss by masking their rows:
  `mask = mask * jnp.repeat(~constant_group_mask(r), K)[:, None]` (with N counted as in `loss_normalizer`, that equals
  removing them). To shrink the batch itself on the host use `drop_constant_groups`.
  """
  rewards = jnp.asarray(rewards)
  return (rewards.max(-1) - rewards.min(-1)) <= atol


def drop_constant_groups(rewards: Any, *rows: Any, atol: float = 0.0) -> tuple[np.ndarray, ...]:
  """Host-side (numpy; output shapes depend on values, so not for jit): removes groups whose rewards are all equal.

  rewards: [G, K]. Each of `rows` has leading axis G (one entry per group) or G*K (one per sample, group-major, the
  layout of a rollout batch). Returns (rewards[kept], *rows[kept]) with the same layouts.
  """
  rewards = np.asarray(rewards)
  num_groups, group_size = rewards.shape
  keep = ~np.asarray(constant_group_mask(rewards, atol=atol))  # [G]
  out = [rewards[keep]]
  for i, row in enumerate(rows):
    row = np.asarray(row)
    if row.shape[0] == num_groups * group_size:
      out.append(row[np.repeat(keep, group_size)])
    elif row.shape[0] == num_groups:
      out.append(row[keep])
    else:
      raise ValueError(f"jaxrlvr/objectives.py: drop_constant_groups row {i} has leading size {row.shape[0]}; "
                       f"expected G={num_groups} or G*K={num_groups * group_size}")
  return tuple(out)


# ----------------------------------------------------------------------------------------------------------------
# The `loss.*` config keys.


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """The `loss.*` config keys, validated and in the form the functions above take (None where the config says off)."""
  scale_by_std: bool = False  # GRPO std scaling of advantages; False is Dr.GRPO
  clip: bool = True  # PPO clip for fresh tokens
  clip_low: float = 0.2  # epsilon_low: ratio floor 1 - clip_low
  clip_high: float = 0.2  # epsilon_high: ratio ceiling 1 + clip_high (DAPO clip-higher when != clip_low)
  dual_clip: float | None = None  # c of dual-clip PPO (> 1); config 0 means None
  shaping_beta: float | None = None  # ExGRPO's beta of f(w) = w / (w + beta); None (config 0): replayed as fresh
  mixed_clip: bool = False  # ExGRPO: keep clipping fresh tokens in the mixed phase (paper eq. 4); False: released code
  aggregation: str = "dr_grpo"
  max_len: int | None = None  # L of dr_grpo / exgrpo_reference; config 0 means rollout.max_new_tokens
  reference_width: str = "max_len"  # exgrpo_reference: divide by L ("max_len") or the batch's padded width ("padded")
  reference_divisor: int = 1  # exgrpo_reference: gradient-accumulation divisor D; 0: the step's micro-batch count
  entropy_coef: float = 0.0
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  importance_cap: float | None = None  # truncated importance weights cap c; config 0 means None (off)
  drop_constant_groups: bool = False

  def __post_init__(self):
    _check_mode(self.aggregation)
    _check_clip_args(self.clip_low, self.clip_high, self.dual_clip, self.shaping_beta)
    if self.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(f"jaxrlvr/objectives.py: loss.kl_estimator={self.kl_estimator!r} is not one of "
                       f"{', '.join(KL_ESTIMATORS)}")
    if self.importance_cap is not None and self.importance_cap <= 0:
      raise ValueError(f"jaxrlvr/objectives.py: loss.importance_cap must be > 0 (or 0 for off), got "
                       f"{self.importance_cap}")
    if self.max_len is not None and self.max_len <= 0:
      raise ValueError(f"jaxrlvr/objectives.py: loss.max_len must be > 0, got {self.max_len}")
    if self.reference_width not in REFERENCE_WIDTHS:
      raise ValueError(f"jaxrlvr/objectives.py: loss.reference_width={self.reference_width!r} is not one of "
                       f"{', '.join(REFERENCE_WIDTHS)}")
    if self.reference_divisor < 0:
      raise ValueError(f"jaxrlvr/objectives.py: loss.reference_divisor must be >= 0 (0: the micro-batch count), got "
                       f"{self.reference_divisor}")

  @classmethod
  def from_config(cls, config: Any) -> "LossSettings":
    """Reads config.loss.* (and config.rollout.max_new_tokens when loss.max_len is 0)."""
    loss = config.loss
    if loss.dual_clip < 0 or loss.importance_cap < 0 or loss.max_len < 0 or loss.shaping_beta < 0:
      raise ValueError(f"jaxrlvr/objectives.py: loss.dual_clip ({loss.dual_clip}), loss.importance_cap "
                       f"({loss.importance_cap}), loss.shaping_beta ({loss.shaping_beta}) and loss.max_len "
                       f"({loss.max_len}) must be >= 0 (0 means off/default)")
    return cls(
        scale_by_std=bool(loss.scale_by_std), clip=bool(loss.clip), clip_low=float(loss.clip_low),
        clip_high=float(loss.clip_high), dual_clip=float(loss.dual_clip) if loss.dual_clip else None,
        shaping_beta=float(loss.shaping_beta) if loss.shaping_beta else None, mixed_clip=bool(loss.mixed_clip),
        aggregation=str(loss.aggregation), max_len=int(loss.max_len or config.rollout.max_new_tokens),
        reference_width=str(loss.get("reference_width", "max_len")),
        reference_divisor=int(loss.get("reference_divisor", 1)),
        entropy_coef=float(loss.entropy_coef), kl_coef=float(loss.kl_coef), kl_estimator=str(loss.kl_estimator),
        importance_cap=float(loss.importance_cap) if loss.importance_cap else None,
        drop_constant_groups=bool(loss.drop_constant_groups))

  def policy_loss_kwargs(self, *, mixed_phase: Any = False) -> dict[str, Any]:
    """Keyword arguments of `token_policy_loss`. mixed_phase: ExGRPO's replay-is-on switch (Python or traced bool;
    always False for other methods): there, fresh tokens lose their clip unless mixed_clip is set."""
    if isinstance(mixed_phase, (bool, np.bool_)):
      clip = self.clip and (self.mixed_clip or not mixed_phase)
    else:
      clip = jnp.logical_and(self.clip, jnp.logical_or(self.mixed_clip, jnp.logical_not(mixed_phase)))
    return dict(clip=clip, clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
                shaping_beta=self.shaping_beta)

  def aggregate_kwargs(self) -> dict[str, Any]:
    """Keyword arguments of `aggregate_loss` / `loss_normalizer`."""
    padded = self.aggregation == "exgrpo_reference" and self.reference_width == "padded"
    return dict(mode=self.aggregation, max_len=None if padded else self.max_len)

  def normalizer_kwargs(self, *, num_ranks: int, num_microbatches: int) -> dict[str, Any]:
    """Keyword arguments of `loss_normalizer` for one optimizer step of `num_microbatches` micro-batches whose rows
    are spread over `num_ranks` data-parallel shards (only exgrpo_reference depends on them)."""
    return dict(**self.aggregate_kwargs(), reference_ranks=num_ranks,
                reference_divisor=self.reference_divisor or num_microbatches)
